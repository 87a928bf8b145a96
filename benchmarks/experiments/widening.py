"""How often a decoded token falls off its block's per-channel K grids, on a real model's keys.

The cache write codes an appended token on the block's stored per-channel grids (statistics per
channel, docs/formats.md); a channel whose new value falls off its grid takes new statistics, and
the write re-encodes that channel's storage unit (a byte holds 8 / bits channels) in every earlier
row of the block. This counts, block by block along each text, the units widened per appended
token and KV head and the rows they rewrite: the work the write's re-encoding does on real keys.
It also measures what appending costs in accuracy: the RMS error of K decoded from blocks written
token by token through the torch codec (``MinMaxCodec.encode``, as ``paged_torch.write_tokens``
calls it), against the same blocks encoded whole, as a prefill writes them.

    python benchmarks/experiments/widening.py [--model-dir models/smollm2-135m-instruct] [--bits 4] [--texts 2]

Keys come from a Hugging Face forward pass over ShareGPT conversations (after RoPE, as vLLM caches
them); the same count on Gaussian keys of the same shape is printed for comparison.
"""

from __future__ import annotations

import argparse

import torch


def widening(keys: torch.Tensor, bits: int, block: int) -> tuple[float, float]:
    """keys [T, H, D] -> (units widened, unit-rows rewritten) per appended token and head, over the
    whole blocks of ``keys``, every token appended alone (decoding). A value fits its channel's stored
    grid when its code, floor((x - zero) / scale + 1/2), lies in [0, 2^bits - 1]; a channel it does
    not fit widens to span its grid and the value, with the codec's margin beyond the side the value
    passed (``widened_span``): float16 zero = lo and scale = (hi - zero) / (2^bits - 1). Bytes of
    8 / bits channels (2, 4 or 8 bits)."""
    from vllm_kvcompress.formats.codecs import widened_span

    if bits not in (2, 4, 8):
        raise SystemExit(f"--bits {bits}: 2, 4 or 8 (a 3-bit unit is an 11-channel word)")
    top, vals = (1 << bits) - 1, 8 // bits
    T, H, D = keys.shape
    widened = rewritten = appended = 0
    for start in range(0, T - block + 1, block):
        blk = keys[start:start + block].float()
        zero, scale = _grid(blk[0], blk[0], top)
        for n in range(1, block):
            code = torch.floor((blk[n] - zero) / scale + 0.5)
            off_grid = (code < 0) | (code > top)
            new_zero, new_scale = _grid(*widened_span(blk[n], blk[n], zero, zero + scale * top), top)
            zero, scale = torch.where(off_grid, new_zero, zero), torch.where(off_grid, new_scale, scale)
            units = off_grid.view(H, D // vals, vals).any(-1).sum().item()
            widened += units
            rewritten += units * n
            appended += H
    return widened / appended, rewritten / appended


def _grid(lo: torch.Tensor, hi: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    zero = lo.half().float()
    return zero, ((hi - zero) / top).clamp_min(1e-6).half().float()


def append_error(keys: torch.Tensor, bits: int, block: int) -> tuple[float, float]:
    """keys [T, H, D] -> RMS error of the decoded whole blocks of ``keys``, (every token appended
    alone, each block encoded at once)."""
    from vllm_kvcompress.formats import MinMaxCodec

    T, H, D = keys.shape
    codec = MinMaxCodec(bits, "channel", False, block, H, D)
    appended = whole = 0.0
    blocks = T // block
    for start in range(0, blocks * block, block):
        x = keys[None, start:start + block].float()
        pages = codec.encode(x, torch.tensor([1]))
        for n in range(1, block):
            rows = codec.decode(pages)
            rows[0, n] = x[0, n]
            pages = codec.encode(rows, torch.tensor([n + 1]), pages, torch.tensor([n]))
        appended += (codec.decode(pages) - x).square().sum().item()
        whole += (codec.decode(codec.encode(x, torch.tensor([block]))) - x).square().sum().item()
    count = blocks * block * H * D
    return (appended / count) ** 0.5, (whole / count) ** 0.5


def model_keys(model_dir: str, texts: list[str], max_tokens: int) -> list[list[torch.Tensor]]:
    """Per text, per layer, the cached keys [T, H, D] of a forward pass."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
            cache = model(ids, use_cache=True).past_key_values
            out.append([layer.keys[0].transpose(0, 1) for layer in cache.layers])
    return out


def main() -> None:
    from vllm_kvcompress.tools.datasets import dataset_texts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="models/smollm2-135m-instruct")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--texts", type=int, default=2, help="ShareGPT conversations of at least --tokens tokens")
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    texts = [t for t in dataset_texts("sharegpt") if len(t) > 6 * args.tokens][:args.texts]
    per_text = model_keys(args.model_dir, texts, args.tokens)
    layers = [widening(k, args.bits, args.block) for keys in per_text for k in keys]
    T, H, D = per_text[0][0].shape
    units = D * args.bits // 8
    print(f"{args.model_dir}: {len(texts)} ShareGPT texts of {T} tokens, {len(per_text[0])} layers, "
          f"{H} KV heads of {D}, {args.bits}-bit K in {args.block}-token blocks")
    print(f"  units widened per appended token and head: {sum(w for w, _ in layers) / len(layers):.2f} of {units}"
          f" (layers {min(w for w, _ in layers):.2f} to {max(w for w, _ in layers):.2f})")
    print(f"  unit-rows rewritten per appended token and head: {sum(r for _, r in layers) / len(layers):.1f}")
    errors = [append_error(k, args.bits, args.block) for keys in per_text for k in keys]
    appended, whole = (sum(e[i] for e in errors) / len(errors) for i in (0, 1))
    print(f"  K RMS error, mean over layers: appended token by token {appended:.4f}, blocks encoded whole "
          f"{whole:.4f} ({appended / whole:.3f}x)")
    w, r = widening(torch.randn(T, H, D, generator=torch.Generator().manual_seed(0)), args.bits, args.block)
    print(f"  Gaussian keys, same shape: {w:.2f} units widened, {r:.1f} unit-rows rewritten")


if __name__ == "__main__":
    main()
