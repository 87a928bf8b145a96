"""The Triton decode for K-only pages against attention with V built in full: V = RoPE^-1(K) W_KV.

Runs on the CPU in Triton's interpreter (small shapes) and on the GPU where present.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from vllm_kvcompress import paged_torch  # noqa: E402
from vllm_kvcompress.config import LayerFormat  # noqa: E402
from vllm_kvcompress.formats import KVPageFormat  # noqa: E402
from vllm_kvcompress.slim import Rotary, SlimLayer  # noqa: E402
from vllm_kvcompress.triton_kernels.slim_decode import slim_decode  # noqa: E402
from vllm_kvcompress.kernels import registry  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rope_table(max_pos: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """[max_pos, dim] = [cos | sin] of pos * theta^(-2i/dim): the RoPE of the Llama paper."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def unrope_reference(k: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate each position back by its angle, written as the inverse 2x2 rotation on (x_i, x_{i+D/2})."""
    half = k.shape[-1] // 2
    cos, sin = table[:k.shape[0], :half, None].transpose(1, 2), table[:k.shape[0], half:, None].transpose(1, 2)
    x1, x2 = k[..., :half], k[..., half:]
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)


def run(seq_lens, heads, head_size, block, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    fmt = KVPageFormat.from_layer_format(LayerFormat(k_only=True), dtype, block, heads, head_size)
    table = rope_table(max(seq_lens) + 1, head_size)
    size = heads * head_size
    w_kv = torch.randn(size, size, generator=gen) / size ** 0.5
    slim = SlimLayer.from_w_kv(w_kv.to(dtype), heads, Rotary(table, head_size, True))
    ctx = registry.LayerContext(registry.Device("cuda", (9, 0)), dtype, heads, rotary=slim.rotary)
    assert registry.plan(fmt, ctx, registry.KernelPolicy()).decode.name == "triton-slim"
    max_blocks = max(-(-L // block) for L in seq_lens)
    num_blocks = sum(-(-L // block) for L in seq_lens) + 3
    cache = torch.zeros(num_blocks, fmt.page_bytes, dtype=torch.uint8)
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    q = torch.randn(len(seq_lens), heads, head_size, generator=gen).to(dtype)
    want = []
    used = 0
    for i, L in enumerate(seq_lens):
        nb = -(-L // block)
        bt[i, :nb] = perm[used:used + nb]
        used += nb
        k = (torch.randn(L, heads, head_size, generator=gen) + 0.2).to(dtype)
        slots = bt[i, torch.arange(L) // block].long() * block + torch.arange(L) % block
        paged_torch.write_tokens(cache, fmt, k, k, slots)
        v = (unrope_reference(k.float(), table).flatten(1) @ w_kv.to(dtype).float()).view(L, heads, head_size)
        probs = (torch.einsum("hd,lhd->hl", q[i].float(), k.float()) * head_size ** -0.5).softmax(-1)
        want.append(torch.einsum("hl,lhd->hd", probs, v))
    slim_dev = SlimLayer(slim.w_heads.to(DEVICE), Rotary(table.to(DEVICE), head_size, True))
    got = slim_decode(q.to(DEVICE), cache.to(DEVICE), fmt, bt.to(DEVICE),
                      torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), head_size ** -0.5, max(seq_lens),
                      slim_dev)
    return got.float().cpu(), torch.stack(want)


@pytest.mark.parametrize("seq_lens", [[1, 17, 40], [64, 3]])
def test_slim_decode_equals_full_v_attention_small(seq_lens):
    got, want = run(seq_lens, heads=2, head_size=32, block=16, dtype=torch.float16)
    torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads, head_size, block", [(32, 128, 128), (16, 64, 16), (8, 256, 64)])
def test_slim_decode_equals_full_v_attention_gpu(heads, head_size, block):
    got, want = run([1, 200, 1000, 4097], heads, head_size, block, torch.bfloat16, seed=heads)
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
