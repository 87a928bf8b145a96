"""ZipCache's CUDA decode write over split-row pages (csrc/salient_rows_write_kernel.cu) against the
torch reference's writes into the slot-map page. The kernel tests need a GPU, and nvcc or the prebuilt
kernels; the struct check runs everywhere."""

import pytest
import torch

from vllm_kvcompress import cuda_salient_rows_write
from vllm_kvcompress.config import SalientSpec
from vllm_kvcompress.formats.salient_rows import SalientRowsFormat
from vllm_kvcompress.kernels import registry
from vllm_kvcompress.salient_torch import attend_and_write
from c_structs import c_struct_fields
from test_cuda_salient_write import _log_sum_exps

needs_cuda_kernels = pytest.mark.skipif(registry.why_no_cuda_kernels_here() is not None,
                                        reason="needs a CUDA GPU, and nvcc or the prebuilt kernels")


def test_launch_arguments_mirror_the_kernels_struct():
    assert cuda_salient_rows_write._SalientRowsWriteArgs._fields_ == c_struct_fields("salient_rows_write_kernel.cu",
                                                                                      "SalientRowsWriteArgs")


def _filled(table, lens, B, num_blocks):
    """[num_blocks] the tokens each block holds."""
    filled = torch.zeros(num_blocks, dtype=torch.long)
    for i, L in enumerate(lens):
        for j in range(-(-L // B)):
            filled[table[i, j].long()] = min(B, L - j * B)
    return filled


@needs_cuda_kernels
@pytest.mark.parametrize("D,B,dtype", [(64, 64, torch.bfloat16), (128, 64, torch.bfloat16),
                                       (128, 128, torch.float16), (256, 64, torch.float16)],
                         ids=["64", "128", "128-block-128", "256"])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("score", ["normalized", "random"])
@pytest.mark.parametrize("group", [1, 4], ids=["mha", "gqa"])
def test_decode_steps_write_the_tokens_the_torch_path_writes(D, B, dtype, window, score, group):
    """Decode steps of three requests written all at once by the kernel into split-row pages, against
    ``attend_and_write`` one request at a time into the slot-map pages of the same tokens, with the
    same log-sum-exps: after each step the same tokens keep 4 bits and every token reads as the same
    K and V. The steps cross a re-compression (context 100) and block boundaries; every other step K
    stays inside its channels' grids, the others widen (every channel every fourth step); a block's
    4-bit half fills (the least-scored candidate drops to 2 bits, its row moved)."""
    H = 2
    fmt = SalientRowsFormat.create(dtype, B, H, D)
    spec = SalientSpec(ratio=0.5, score=score)
    scale = D ** -0.5
    g = torch.Generator().manual_seed(D + B)
    draw = lambda *shape: torch.randn(*shape, generator=g).to(dtype).float()  # noqa: E731
    lens = [90, 60, 31]  # prompts; then decodes to 104, 74, 45 tokens
    table = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)
    cache = torch.zeros(12, fmt.page_bytes, dtype=torch.uint8)
    for i, L in enumerate(lens):
        attend_and_write(draw(L, H * group, D), draw(L, H, D), draw(L, H, D), cache, fmt.slot_map, spec, [0, L], [L],
                         table[i:i + 1], scale, window)
    ours = fmt.from_slot_map(cache, _filled(table, lens, B, 12)).cuda()
    dropped = 0
    for step in range(14):
        lens = [L + 1 for L in lens]
        q, k, v = draw(3, H * group, D), draw(3, H, D), draw(3, H, D)
        k = (k * (0.1 if step % 2 else 1.0 if step % 4 else 4.0)).to(dtype).float()
        lse = _log_sum_exps(fmt.slot_map, cache, table, lens, q, k, scale, window)
        before = fmt.slot_map.salient(cache).sum().item()
        attend_and_write(q, k, v, cache, fmt.slot_map, spec, [0, 1, 2, 3], lens, table, scale, window)
        dropped += before + 3 > fmt.slot_map.salient(cache).sum().item()
        seq_lens = torch.tensor(lens, dtype=torch.int32).cuda()
        cuda_salient_rows_write.write_decoded(q.to(dtype).cuda(), k.to(dtype).cuda(), v.to(dtype).cuda(), ours, fmt,
                                              spec, table.cuda(), seq_lens, lse.cuda(), scale, window)
        got = ours.cpu()
        for i, L in enumerate(lens):
            blocks = table[i, :-(-L // B)].long()
            assert torch.equal(fmt.salient(got[blocks]).flatten(0, 1)[:L],
                               fmt.slot_map.salient(cache[blocks]).flatten(0, 1)[:L]), (step, i)
            for a, b in zip(fmt.decode(got[blocks]), fmt.slot_map.decode(cache[blocks])):
                assert torch.equal(a.flatten(0, 1)[:L], b.flatten(0, 1)[:L]), (step, i)
    assert dropped > 0  # some step chose which tokens lose their 4 bits


@needs_cuda_kernels
def test_padding_rows_write_nothing():
    """A full CUDA graph's rows of context 0 write nothing, whatever their block table row holds."""
    H, D, B = 2, 128, 64
    fmt = SalientRowsFormat.create(torch.bfloat16, B, H, D)
    cache = torch.randint(0, 255, (4, fmt.page_bytes), dtype=torch.uint8).cuda()
    before = cache.clone()
    q, k, v = (torch.randn(2, H, D, dtype=torch.bfloat16).cuda() for _ in range(3))
    lse = torch.zeros(2, H).cuda()
    table, lens = torch.zeros(2, 1, dtype=torch.int32).cuda(), torch.zeros(2, dtype=torch.int32).cuda()
    cuda_salient_rows_write.write_decoded(q, k, v, cache, fmt, SalientSpec(ratio=0.5), table, lens, lse, D ** -0.5)
    torch.cuda.synchronize()
    assert torch.equal(cache, before)
