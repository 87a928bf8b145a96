"""The split-row ZipCache page (formats/salient_rows.py) against the slot-map page it rearranges."""

import pytest
import torch

from vllm_kvcompress.formats import MinMaxCodec
from vllm_kvcompress.formats.salient import REFINE_BITS
from vllm_kvcompress.formats.salient_rows import EMPTY, SalientRowsFormat

SHAPES = [(128, 2, 128), (64, 2, 64), (32, 3, 64)]  # block, KV heads, head size


def _slot_map_pages(fmt: SalientRowsFormat, seed: int):
    """Slot-map pages of blocks filled to B, B - 1, just past half, 1 and 7 tokens, half of each
    block's tokens (at most) salient, drawn at random; and the blocks' token counts."""
    B, H, D = fmt.block_size, fmt.k.num_heads, fmt.k.head_size
    g = torch.Generator().manual_seed(seed)
    filled = torch.tensor([B, B - 1, B // 2 + 3, 1, 7])
    k, v = (torch.randn(len(filled), B, H, D, generator=g) for _ in range(2))
    salient = torch.rand(len(filled), B, H, generator=g).argsort(1) < fmt.rows
    return fmt.slot_map.encode(k, v, filled, salient), filled


@pytest.mark.parametrize("B,H,D", SHAPES)
def test_the_same_bytes_as_the_slot_map_page(B, H, D):
    fmt = SalientRowsFormat.create(torch.bfloat16, B, H, D)
    assert fmt.page_bytes == fmt.slot_map.page_bytes
    assert fmt.slot_map.ratio == 0.5 and fmt.rows == fmt.slot_map.slots == B // 2


@pytest.mark.parametrize("B,H,D", SHAPES)
def test_pages_read_as_the_slot_map_pages_they_came_from(B, H, D):
    """Every written token reads as the same K and V, keeps its precision, and goes back to a
    slot-map page that reads the same; rows that hold no token are EMPTY."""
    fmt = SalientRowsFormat.create(torch.bfloat16, B, H, D)
    slot_pages, filled = _slot_map_pages(fmt, B + H + D)
    pages = fmt.from_slot_map(slot_pages, filled)
    written = (torch.arange(B)[None, :] < filled[:, None])[..., None]  # [N, B, 1]
    want = fmt.slot_map.decode(slot_pages)
    for got, ref in zip(fmt.decode(pages), want):
        assert torch.equal(got, torch.where(written[..., None], ref, 0.0))
    assert torch.equal(fmt.salient(pages), fmt.slot_map.salient(slot_pages) & written)
    for got, ref in zip(fmt.slot_map.decode(fmt.to_slot_map(pages)), want):
        assert torch.equal(torch.where(written[..., None], got, 0.0), torch.where(written[..., None], ref, 0.0))
    held = fmt.place_of(pages) != EMPTY
    assert torch.equal(held.sum(1), filled[:, None].expand(-1, H))


@pytest.mark.parametrize("B,H,D", SHAPES)
def test_each_half_is_laid_out_as_a_quant_page_of_half_the_block(B, H, D):
    """What lets a decode kernel read a page as a 4-bit and a 2-bit half-page: each half's K rows
    (head-major) and V rows (groups of 32 rows, byte-major) hold, as the 4-bit and 2-bit codecs'
    pages of B / 2 tokens hold them, the 4-bit codes of the row's token (its top two bits in the
    2-bit half), and each row's V statistics are its token's."""
    fmt = SalientRowsFormat.create(torch.bfloat16, B, H, D)
    slot_pages, filled = _slot_map_pages(fmt, 3 * B + D)
    pages = fmt.from_slot_map(slot_pages, filled)
    rows, place = fmt.rows, fmt.place_of(pages)
    held = place != EMPTY
    token = torch.where(held, place, 0)
    sm = fmt.slot_map
    v_stats = {s: sm.regions.view(slot_pages, f"v_{s}", torch.float16, (H, B)).transpose(1, 2)
               for s in ("scale", "zero")}
    for bits, half, first in ((4, "4", 0), (2, "2", rows)):
        at = slice(first, first + rows)
        for name, axis in (("k", "channel"), ("v", "token")):
            codec = MinMaxCodec(bits, axis, False, rows, H, D)
            codec_page = torch.zeros(len(filled), codec.nbytes, dtype=torch.uint8)
            start, size = fmt.regions.offsets[f"{name}{half}"]
            codec.regions.write(codec_page, "codes", pages[:, start:start + size])
            got = codec._page_codes(codec_page)  # [N, rows, H, D]
            want = sm._codes(slot_pages, name).gather(1, token[:, at, :, None].expand(-1, -1, -1, D))
            if bits == 2:
                want = want >> REFINE_BITS
            assert torch.equal(torch.where(held[:, at, :, None], got, 0), torch.where(held[:, at, :, None], want, 0))
        for s in ("scale", "zero"):
            got = fmt.regions.view(pages, f"v{half}_{s}", torch.float16, (H, rows)).transpose(1, 2)
            want = v_stats[s].gather(1, token[:, at])
            assert torch.equal(torch.where(held[:, at], got, 0), torch.where(held[:, at], want, 0))
    # the 4-bit half holds the salient tokens, the 2-bit half the others
    salient = sm.salient(slot_pages).gather(1, token)
    assert torch.equal(salient & held, torch.arange(B)[None, :, None].lt(rows) & held)


def test_bad_block_sizes_are_refused():
    for B in (33, 256):
        with pytest.raises(ValueError, match=f"block size {B}"):
            SalientRowsFormat.create(torch.bfloat16, B, 2, 64)


def test_more_tokens_of_one_precision_than_a_half_holds_are_refused():
    """A slot-map block of B tokens with fewer than B / 2 salient has more 2-bit tokens than rows."""
    fmt = SalientRowsFormat.create(torch.float32, 32, 1, 64)
    k, v = torch.randn(1, 32, 1, 64), torch.randn(1, 32, 1, 64)
    few = torch.arange(32)[None, :, None] < 4
    pages = fmt.slot_map.encode(k, v, torch.tensor([32]), few)
    with pytest.raises(ValueError, match="more than 16 tokens of one precision"):
        fmt.from_slot_map(pages, torch.tensor([32]))
