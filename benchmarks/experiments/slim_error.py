"""How much error a quantized K page brings to slim attention's rebuilt V = RoPE^-1(K) W_KV.

For a square W_K/W_V pair and hidden states x, compares the relative error of
  - V rebuilt from K stored at 16 bits (the model dtype), and at 8/4 bits (per channel, 128-token blocks),
  - V stored directly at the same bits (per token, as the quant-kXvX presets do),
so the table says what a K-only 8-bit page costs against K8/V8 pages. Weights are
random (no real multi-head-attention checkpoint is available offline) with a
chosen condition number: the error of the rebuilt V grows with cond(W_K).

    python benchmarks/experiments/slim_error.py [--hidden 4096] [--heads 32] [--tokens 1024]
"""

from __future__ import annotations

import argparse

import torch

from vllm_kvcompress.config import LayerFormat
from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.slim import Rotary, k_rounding, w_kv_from_projections


def rope_table(max_pos: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def matrix_with_condition(n: int, cond: float, gen: torch.Generator) -> torch.Tensor:
    u = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0]
    singular = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), n, dtype=torch.float64)
    return (u * singular) @ v.T / n ** 0.5


def round_trip(x: torch.Tensor, bits: int, axis: str, dtype: torch.dtype, heads: int, block: int = 128):
    """x [L, H, D] through a page of ``bits`` (16: the model dtype)."""
    lf = LayerFormat(k_bits=bits, v_bits=16, k_axis=axis)
    fmt = KVPageFormat.from_layer_format(lf, dtype, block, heads, x.shape[-1])
    L = x.shape[0]
    blocks = x.to(dtype).float().view(L // block, block, heads, -1)
    k, _ = fmt.decode(fmt.encode(blocks, blocks, torch.full((L // block,), block)))
    return k.reshape(L, heads, -1)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    d = args.hidden // args.heads
    table = rope_table(args.tokens, d)
    rotary = Rotary(table, d, True)
    positions = torch.arange(args.tokens)
    x = torch.randn(args.tokens, args.hidden, generator=gen, dtype=torch.float64)
    w_v = matrix_with_condition(args.hidden, 10.0, gen)
    print(f"hidden {args.hidden}, {args.heads} heads, {args.tokens} tokens, K/V stored as {args.dtype}")
    print("| cond(W_K) | amplification | V from K16 (expected) | V from K8 (expected) | V from K4 | "
          "V stored at 8 bits | V stored at 4 bits |")
    print("|---|---|---|---|---|---|---|")
    for cond in (10.0, 1e2, 1e3, 1e4):
        w_k = matrix_with_condition(args.hidden, cond, gen)
        w_kv, measured = w_kv_from_projections(w_k.T, w_v.T)
        k_pre = (x @ w_k).float().view(args.tokens, args.heads, d)
        v = (x @ w_v).float().view(args.tokens, args.heads, d)
        k_post = _rotate(k_pre, table)
        row = [f"{measured.cond:.0e}", f"{measured.amplification:.3g}"]
        for bits in (16, 8, 4):
            k_back = rotary.unrotate(round_trip(k_post, bits, "channel", dtype, args.heads), positions)
            v_hat = (k_back.flatten(1).double() @ w_kv).view_as(v)
            expected = f" ({measured.amplification * k_rounding(bits, dtype):.2e})" if bits != 4 else ""
            row.append(f"{relative(v_hat.float(), v):.2e}{expected}")
        for bits in (8, 4):
            row.append(f"{relative(round_trip(v, bits, 'token', dtype, args.heads), v):.2e}")
        print("| " + " | ".join(row) + " |")


def _rotate(k: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    half = k.shape[-1] // 2
    cos, sin = table[:k.shape[0], None, :half], table[:k.shape[0], None, half:]
    x1, x2 = k[..., :half], k[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


if __name__ == "__main__":
    main()
