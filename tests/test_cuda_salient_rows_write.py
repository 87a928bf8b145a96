"""ZipCache's CUDA decode write over split-row pages (csrc/salient_rows_write_kernel.cu) against the
torch reference's writes into the slot-map page. The kernel tests need a GPU, and nvcc or the prebuilt
kernels; the struct check runs everywhere."""

import pytest
import torch

from vllm_kvcompress import cuda_salient_rows_write
from vllm_kvcompress.config import SalientSpec
from vllm_kvcompress.formats.salient_rows import SalientRowsFormat
from c_structs import c_struct_fields
from paged_cases import block_fills
from test_cuda_salient_write import needs_cuda_kernels, reference_decode_steps


def test_launch_arguments_mirror_the_kernels_struct():
    assert cuda_salient_rows_write._SalientRowsWriteArgs._fields_ == c_struct_fields("salient_rows_write_kernel.cu",
                                                                                      "SalientRowsWriteArgs")


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
    fmt = SalientRowsFormat.create(dtype, B, 2, D)
    spec, scale = SalientSpec(ratio=0.5, score=score), D ** -0.5
    steps = reference_decode_steps(fmt.slot_map, spec, group, window)
    cache, table, prompts = next(steps)
    ours = fmt.from_slot_map(cache, block_fills(table, prompts, B, len(cache))).cuda()
    dropped = 0
    for step, (lens, q, k, v, lse, drop) in enumerate(steps):
        dropped += drop
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
