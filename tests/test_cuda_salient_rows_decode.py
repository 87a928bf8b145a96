"""ZipCache's CUDA decode over split-row pages (``salient_rows_decode`` in ``csrc/decode_kernel.cu``)
against attention over the pages' tokens as the torch reference reads them.

Runs where a CUDA GPU and nvcc (or the prebuilt kernels) are present; the struct check runs everywhere.
"""

import pytest
import torch

from vllm_kvcompress import cuda_salient_rows_decode
from vllm_kvcompress.formats.salient_rows import EMPTY, SalientRowsFormat
from c_structs import c_struct_fields
from paged_cases import block_fills, salient_pages
from test_cuda_salient_decode import _want, gpu


def test_launch_arguments_mirror_the_kernels_struct():
    assert cuda_salient_rows_decode._SalientRowsDecodeArgs._fields_ == c_struct_fields("decode_kernel.cu",
                                                                                        "SalientRowsDecodeArgs")


def rows_pages(fmt: SalientRowsFormat, history: list[int], seed: int, shuffled: bool):
    """Split-row pages of random tokens (half of a block's at 4 bits, drawn at random), a page each
    block of a row's history, behind a scattered block table; ``shuffled``: each half's rows in a
    random order, the empty ones among them (as writes leave a page between re-compressions)."""
    B, H = fmt.block_size, fmt.k.num_heads
    slot_pages, table = salient_pages(fmt.slot_map, history, 3, seed)
    pages = fmt.from_slot_map(slot_pages, block_fills(table, history, B, len(slot_pages)))
    if shuffled:
        g = torch.Generator().manual_seed(seed + 1)
        order = torch.cat([torch.rand(len(pages), fmt.rows, H, generator=g).argsort(1) + first
                           for first in (0, fmt.rows)], 1)  # [N, B, H]: a row's new place within its half
        codes, stats, place = fmt.row_codes(pages), fmt.row_stats(pages), fmt.place_of(pages)
        moved = lambda x: x.gather(1, order.reshape(*order.shape, *[1] * (x.dim() - 3)).expand_as(x))  # noqa: E731
        grid = {f"k_{s}": fmt.regions.view(pages, f"k_{s}", torch.float16, (H, fmt.k.head_size))
                for s in ("scale", "zero")}
        pages = fmt.pack_rows({n: moved(c) for n, c in codes.items()}, {n: moved(st) for n, st in stats.items()},
                              moved(place), grid)
    assert (fmt.place_of(pages) == EMPTY).any()  # some half holds fewer rows than it has
    return pages, table


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("shuffled", [False, True], ids=["rows-in-order", "rows-shuffled"])
def test_decode_rows_equal_attention_over_the_pages_tokens(shuffled, splits, dtype):
    """Rows over their history (a row of none, rows ending inside either half of a page and on a
    page's end) and their own new token, in one split, three or the launch's own count: the output
    and the log-sum-exp equal attention over the pages' tokens as ``SalientRowsFormat.decode`` reads
    them, whatever the order of a half's rows."""
    H, D, B = 3, 128, 128
    fmt = SalientRowsFormat.create(dtype, B, H, D)
    history = [0, 17, B, 3 * B - 5, 70, 1000, 2 * B + 64, 1]
    pages, table = rows_pages(fmt, history, 11 + (splits or 0), shuffled)
    g = torch.Generator().manual_seed(5)
    q, k_new, v_new = (torch.randn(len(history), H, D, generator=g).to(dtype).float() for _ in range(3))
    scale = D ** -0.5
    out = torch.empty(len(history), H, D, dtype=dtype, device="cuda")
    lse = cuda_salient_rows_decode.decode_rows(
        *(x.to(dtype).cuda() for x in (q, k_new, v_new)), pages.cuda(), fmt, table.cuda(),
        torch.tensor(history, dtype=torch.int32, device="cuda"), scale, max(history), out, num_splits=splits)
    want, want_lse = _want(fmt, pages, table, history, q, k_new, v_new, scale)
    # float16 factors in the products, as the other CUDA decodes' tests allow
    torch.testing.assert_close(out.float().cpu(), want, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=2e-2, atol=2e-2)


@gpu
def test_the_same_tokens_decode_as_the_slot_map_kernel_decodes_them():
    """The split-row pages of slot-map pages give what the slot-map pages' CUDA decode gives, within
    the float16 rounding both take in their products."""
    from vllm_kvcompress import cuda_salient_decode

    H, D, B = 4, 128, 128
    fmt = SalientRowsFormat.create(torch.bfloat16, B, H, D)
    history = [900, 33, 400, 129, 1, 640]
    slot_pages, table = salient_pages(fmt.slot_map, history, 2, seed=3)
    pages = fmt.from_slot_map(slot_pages, block_fills(table, history, B, len(slot_pages)))
    g = torch.Generator().manual_seed(8)
    q, k_new, v_new = (torch.randn(len(history), H, D, generator=g, dtype=torch.bfloat16).cuda() for _ in range(3))
    lens = torch.tensor(history, dtype=torch.int32, device="cuda")
    outs, lses = [], []
    for module, cache, f in ((cuda_salient_rows_decode, pages, fmt), (cuda_salient_decode, slot_pages, fmt.slot_map)):
        out = torch.empty_like(q)
        lses.append(module.decode_rows(q, k_new, v_new, cache.cuda(), f, table.cuda(), lens, D ** -0.5, max(history),
                                       out))
        outs.append(out.float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lses[0], lses[1], rtol=1e-2, atol=1e-2)
