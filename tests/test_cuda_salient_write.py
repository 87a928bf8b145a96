"""The CUDA kernel of ZipCache's decode write (csrc/salient_write_kernel.cu) against the torch
reference of the same pages. The kernel tests need a GPU, and nvcc or the prebuilt kernels; which
layers it serves is the registry's (tests/test_kernel_registry.py)."""

import pytest
import torch

from vllm_kvcompress import cuda_salient_write
from vllm_kvcompress.config import SalientSpec
from vllm_kvcompress.formats.salient import SalientTokensFormat
from vllm_kvcompress.kernels import registry
from vllm_kvcompress.salient_torch import attend_and_write
from c_structs import c_struct_fields

needs_cuda_kernels = pytest.mark.skipif(registry.why_no_cuda_kernels_here() is not None,
                                        reason="needs a CUDA GPU, and nvcc or the prebuilt kernels")


def test_launch_arguments_mirror_the_kernels_struct():
    assert cuda_salient_write._SalientWriteArgs._fields_ == c_struct_fields("salient_write_kernel.cu",
                                                                            "SalientWriteArgs")


def test_query_heads_not_a_whole_number_a_kv_head_are_refused():
    fmt = SalientTokensFormat.create(0.6, torch.bfloat16, 64, 2, 64)
    q, kv = torch.zeros(1, 3, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="3 query heads for 2 KV heads; allowed: a whole number a KV head"):
        cuda_salient_write.write_decoded(q, kv, kv, torch.zeros(1, fmt.page_bytes, dtype=torch.uint8), fmt,
                                         SalientSpec(ratio=0.6), torch.zeros(1, 1, dtype=torch.int32),
                                         torch.ones(1, dtype=torch.int32), torch.zeros(1, 3), 0.125)


def _log_sum_exps(fmt, pages, table, lens, q, k_new, scale, window):
    """[N, Hq] each row's natural log-sum-exp over its context as the pages hold it, its new token
    exact, within its last ``window`` positions (None: all), in float32 (as the torch path's)."""
    B, H = fmt.block_size, fmt.k.num_heads
    out = []
    for i, L in enumerate(lens):
        k = fmt.decode(pages[table[i, :-(-L // B)].long()])[0].flatten(0, 1)[:L - 1]
        k = torch.cat([k, k_new[i:i + 1].float()])
        logits = torch.einsum("hd,khd->hk", q[i].float(), k.repeat_interleave(q.shape[1] // H, 1)) * scale
        if window is not None:
            logits[:, :L - window] = float("-inf")
        out.append(logits.logsumexp(-1))
    return torch.stack(out)


@needs_cuda_kernels
@pytest.mark.parametrize("D,B,dtype", [(64, 64, torch.bfloat16), (128, 64, torch.bfloat16), (128, 32, torch.bfloat16),
                                       (128, 128, torch.float16), (256, 64, torch.float16)],
                         ids=["64", "128", "128-block-32", "128-block-128", "256"])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("score", ["normalized", "random"])
@pytest.mark.parametrize("group", [1, 4, "most"], ids=["mha", "gqa", "most-query-heads"])
def test_decode_steps_write_the_pages_the_torch_path_writes(D, B, dtype, window, score, group):
    """Decode steps of three requests (MHA, and GQA: 4 query heads a KV head, whose probabilities a
    token's score sums; and the most query heads a KV head the registry gives the kernel at the head
    size, whose probes with the warps' scratch pass the 48 KB of shared memory a launch takes without
    asking), written all at once by the kernel, against
    ``attend_and_write`` one request at a time, with the same log-sum-exps (float32): after each step
    the same 4-bit tokens, and every token reads as the same values. The steps cross a re-compression
    (context 100) and block boundaries; every other step K stays inside its channels' grids (no
    widening), the others widen (every channel every fourth step); a block's slots fill (the
    least-scored candidate dropped); with a sliding window of 40, each probe scores the tokens in its
    window alone."""
    if group == "most":
        group = registry.CUDA_SALIENT_PROBE_FLOATS // (D + 4)
    fmt = SalientTokensFormat.create(0.5, dtype, B, 2, D)
    spec, scale = SalientSpec(ratio=0.5, score=score), D ** -0.5
    steps = reference_decode_steps(fmt, spec, group, window)
    cache, table, _ = next(steps)
    ours = cache.cuda()
    dropped = 0
    for step, (lens, q, k, v, lse, drop) in enumerate(steps):
        dropped += drop
        seq_lens = torch.tensor(lens, dtype=torch.int32).cuda()
        cuda_salient_write.write_decoded(q.to(dtype).cuda(), k.to(dtype).cuda(), v.to(dtype).cuda(), ours, fmt, spec,
                                         table.cuda(), seq_lens, lse.cuda(), scale, window)
        got = ours.cpu()
        assert torch.equal(fmt.salient(got), fmt.salient(cache)), step
        for i, L in enumerate(lens):
            blocks = table[i, :-(-L // B)].long()
            for a, b in zip(fmt.decode(got[blocks]), fmt.decode(cache[blocks])):
                assert torch.equal(a.flatten(0, 1)[:L], b.flatten(0, 1)[:L]), (step, i)
    assert dropped > 0  # some step chose which tokens lose their 4 bits


def reference_decode_steps(fmt: SalientTokensFormat, spec: SalientSpec, group: int, window: int | None):
    """The torch path's pages (``attend_and_write``, one request at a time) of three requests'
    prompts (90, 60, 31 tokens), then of 14 decode steps (to 104, 74, 45 tokens: across a
    re-compression at context 100 and block boundaries), ``group`` query heads a KV head. Every other
    step K stays inside its channels' grids (no widening), the others widen (every channel every
    fourth step), softmax scale D^-0.5. Yields the pages (written in place at each step), the block
    table and the prompts' lengths; then after each step the lengths, query, new K, V, each row's
    log-sum-exp over its context before the step's write (float32), and whether some 4-bit token lost
    its 4 bits."""
    B, H, D, dtype = fmt.block_size, fmt.k.num_heads, fmt.k.head_size, fmt.dtype
    HQ = H * group
    scale = D ** -0.5
    g = torch.Generator().manual_seed(D + B)
    draw = lambda *shape: torch.randn(*shape, generator=g).to(dtype).float()  # noqa: E731
    lens = [90, 60, 31]
    table = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)
    cache = torch.zeros(12, fmt.page_bytes, dtype=torch.uint8)
    for i, L in enumerate(lens):
        attend_and_write(draw(L, HQ, D), draw(L, H, D), draw(L, H, D), cache, fmt, spec, [0, L], [L], table[i:i + 1],
                         scale, window)
    yield cache, table, lens
    for step in range(14):
        lens = [L + 1 for L in lens]
        q, k, v = draw(3, HQ, D), draw(3, H, D), draw(3, H, D)
        k = (k * (0.1 if step % 2 else 1.0 if step % 4 else 4.0)).to(dtype).float()
        lse = _log_sum_exps(fmt, cache, table, lens, q, k, scale, window)
        before = fmt.salient(cache).sum().item()
        attend_and_write(q, k, v, cache, fmt, spec, [0, 1, 2, 3], lens, table, scale, window)
        yield lens, q, k, v, lse, before + 3 > fmt.salient(cache).sum().item()


@needs_cuda_kernels
@pytest.mark.parametrize("pages", ["slot map", "split rows"])
def test_padding_rows_write_nothing(pages):
    """A full CUDA graph's rows of context 0 write nothing, whatever their block table row holds: the
    slot-map pages' write and the split-row pages' (``cuda_salient_rows_write``)."""
    from vllm_kvcompress import cuda_salient_rows_write
    from vllm_kvcompress.formats.salient_rows import SalientRowsFormat

    H, D, B = 2, 128, 64
    if pages == "slot map":
        fmt, spec, write = SalientTokensFormat.create(0.6, torch.bfloat16, B, H, D), SalientSpec(ratio=0.6), \
            cuda_salient_write.write_decoded
    else:
        fmt, spec, write = SalientRowsFormat.create(torch.bfloat16, B, H, D), SalientSpec(ratio=0.5), \
            cuda_salient_rows_write.write_decoded
    cache = torch.randint(0, 255, (4, fmt.page_bytes), dtype=torch.uint8).cuda()
    before = cache.clone()
    q, k, v = (torch.randn(2, H, D, dtype=torch.bfloat16).cuda() for _ in range(3))
    lse = torch.zeros(2, H).cuda()
    table, lens = torch.zeros(2, 1, dtype=torch.int32).cuda(), torch.zeros(2, dtype=torch.int32).cuda()
    write(q, k, v, cache, fmt, spec, table, lens, lse, D ** -0.5)
    torch.cuda.synchronize()
    assert torch.equal(cache, before)
