"""The Triton decode kernel over ZipCache's pages against the torch reference of the same pages.

Runs on the CPU in Triton's interpreter and, where a GPU is present, on the GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "0" if __import__("torch").cuda.is_available() else "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
from vllm_kvcompress.formats.salient import SalientTokensFormat  # noqa: E402
from vllm_kvcompress.triton_kernels.salient_decode import salient_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pages(fmt, seq_lens, spare, seed):
    """Pages of random K/V, each block's salient tokens drawn at random up to its slots, and a
    block table that scatters each request's blocks over the cache."""
    g = torch.Generator().manual_seed(seed)
    B, H, D = fmt.block_size, fmt.k.num_heads, fmt.k.head_size
    counts = [-(-L // B) for L in seq_lens]
    total = sum(counts) + spare
    order = torch.randperm(total, generator=g)
    cache = torch.zeros(total, fmt.page_bytes, dtype=torch.uint8)
    table = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32)
    used = 0
    for i, (L, n) in enumerate(zip(seq_lens, counts)):
        filled = torch.tensor([min(B, L - j * B) for j in range(n)])
        k, v = torch.randn(n, B, H, D, generator=g), torch.randn(n, B, H, D, generator=g) * 2
        salient = torch.rand(n, B, H, generator=g).argsort(1) < torch.minimum(filled, torch.tensor(fmt.slots))[:, None, None]
        blocks = order[used:used + n]
        cache[blocks] = fmt.encode(k, v, filled, salient)
        table[i, :n] = blocks.to(torch.int32)
        used += n
    return cache, table


@pytest.mark.parametrize("HQ", [4, 2, 8])
@pytest.mark.parametrize("block", [32, 128])
def test_salient_decode_equals_attention_over_the_decoded_pages(HQ, block):
    H, D = 2, 64
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    fmt = SalientTokensFormat.create(0.6, dtype, block, H, D)
    seq_lens = [1, 17, block, 3 * block - 5, 70]
    cache, table = _pages(fmt, seq_lens, 3, seed=HQ + block)
    q = torch.randn(len(seq_lens), HQ, D, generator=torch.Generator().manual_seed(5))
    scale = D ** -0.5
    out, lse = salient_decode(q.to(DEVICE, dtype), cache.to(DEVICE), fmt, table.to(DEVICE),
                              torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), scale)
    for i, L in enumerate(seq_lens):
        k, v = (x.flatten(0, 1)[:L] for x in fmt.decode(cache[table[i, :-(-L // block)].long()]))
        logits = torch.einsum("hd,khd->hk", q[i], k.repeat_interleave(HQ // H, 1)) * scale
        want = torch.einsum("hk,khd->hd", logits.softmax(-1), v.repeat_interleave(HQ // H, 1))
        # on the GPU, bfloat16 queries and TF32 products
        tol = 1e-4 if DEVICE == "cpu" else 3e-2
        torch.testing.assert_close(out[i].float().cpu(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(lse[i].cpu(), logits.logsumexp(-1), rtol=tol, atol=tol)


@pytest.mark.parametrize("score", ["normalized", "random"])
def test_decode_steps_through_the_kernel_equal_the_torch_path(score):
    """Decode steps of three requests through the kernel, merged with each new token's exact term and
    written all at once (``decode_and_write``), against ``attend_and_write`` one request at a time:
    the same outputs, and the same pages after each step (the same 4-bit tokens chosen), across a
    re-compression (context 100) and a block boundary. On a GPU, whose products round as TF32, the
    outputs are compared at that precision and the choice (which near-ties may flip) is not."""
    from vllm_kvcompress.config import SalientSpec
    from vllm_kvcompress.salient_torch import attend_and_write, decode_and_write

    H, HQ, D, B = 2, 4, 64, 32
    fmt = SalientTokensFormat.create(0.5, torch.float32, B, H, D)
    spec = SalientSpec(ratio=0.5, score=score)
    g = torch.Generator().manual_seed(9)
    lens = [90, 60, 31]  # prompts; then decodes to 104, 74, 45 tokens
    table = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)
    cache = torch.zeros(12, fmt.page_bytes, dtype=torch.uint8)
    for i, L in enumerate(lens):
        q, k, v = torch.randn(L, HQ, D, generator=g), torch.randn(L, H, D, generator=g), torch.randn(L, H, D, generator=g)
        attend_and_write(q, k, v, cache, fmt, spec, [0, L], [L], table[i:i + 1], D ** -0.5)
    ours = cache.clone()
    for step in range(14):
        lens = [L + 1 for L in lens]
        q, k, v = torch.randn(3, HQ, D, generator=g), torch.randn(3, H, D, generator=g), torch.randn(3, H, D, generator=g)
        want = attend_and_write(q, k, v, cache, fmt, spec, [0, 1, 2, 3], lens, table, D ** -0.5)
        dev = lambda x: x.to(DEVICE)  # noqa: E731
        got = torch.empty_like(dev(q))
        ours_dev = dev(ours)
        decode_and_write(dev(q), dev(k), dev(v), ours_dev, fmt, spec, dev(table),
                         torch.tensor(lens, dtype=torch.int32, device=DEVICE), D ** -0.5, salient_decode, got)
        ours = ours_dev.cpu()
        tol = 1e-4 if DEVICE == "cpu" else 3e-2
        torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
        if DEVICE != "cpu":
            ours = cache.clone()
            continue
        assert torch.equal(fmt.salient(ours), fmt.salient(cache)), step
        for a, b in zip(fmt.decode(ours), fmt.decode(cache)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
