"""ZipCache at r = 0.5 with each precision's tokens in rows of their own (split rows).

The bytes of ``SalientTokensFormat``'s page at r = 0.5, rearranged: a block's 4-bit tokens are the
rows of a 4-bit half (whole 4-bit codes), its 2-bit tokens the rows of a 2-bit half (the top two
bits on the same grid, read as the middle of their four sub-levels, ``4 c + MIDDLE``), and
``place_of`` gives each row's place in the block. Each half is laid out as quant-k4v4's and
quant-k2v2's pages of B / 2 tokens lay out theirs, so a decode kernel reads a page as a 4-bit and a
2-bit half-page, with no joining of two planes into 4-bit codes and no slot gathers: the slot-map
page's decode costs 1.3x quant-k4v4's for that (H200, docs/log/2026-11-30.md, where a kernel over
this layout ran at quant-k4v4's cost). Attention does not depend on the order of a block's tokens
(K is stored after RoPE); ``place_of`` serves what needs positions: a context's last block, sliding
windows, the probes' causal normalization.

Page: K scale, zero [H, D] (float16, the grid both halves share) | per half: K rows [H, B/2, D
bits / 8] head-major, V rows in groups of 32 rows byte-major (``MinMaxCodec``'s per-token layout), V
scale, zero [H, B/2] (float16, each row's 4-bit grid) | place_of [H, B] uint8 (``EMPTY``: no token).

A block never holds more than B / 2 tokens of either precision: the slot-map writer keeps at most
``slots`` = B / 2 tokens at 4 bits, and tokens lose 4 bits only where the slots are full or at a
re-compression, which keeps ``quota(n)`` = ceil(n / 2), so a block of n tokens has at most
max(n - B / 2, floor(n / 2)) at 2 bits.

The torch reference reads and writes these pages through the slot-map page (``to_slot_map``,
``from_slot_map``): ``salient_torch``'s rules, unchanged, decide which tokens keep 4 bits. Which row
a token takes is not part of the contract: tokens read alike is.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .codecs import MinMaxCodec
from .layout import Regions, SlottedPage
from .packing import pack, packed_row_bytes, unpack
from .salient import HIGH_BITS, LOW_BITS, MIDDLE, NO_SLOT, REFINE_BITS, SalientTokensFormat

EMPTY = 255  # place_of of a row that holds no token
RATIO = 0.5  # the one share of 4-bit tokens whose halves are equal (the decode kernel's two warps)
_F16 = torch.float16
_HALVES = ((HIGH_BITS, "4"), (LOW_BITS, "2"))


@dataclass(frozen=True)
class SalientRowsFormat(SlottedPage):
    slot_map: SalientTokensFormat  # the same tokens on the slot-map page (r = 0.5): grids, rules, reference

    @classmethod
    def create(cls, dtype: torch.dtype, block_size: int, num_kv_heads: int, head_size: int) -> "SalientRowsFormat":
        if block_size % 2 or not 2 <= block_size < EMPTY:
            raise ValueError(f"split rows: block size {block_size} is not even, or not in 2..{EMPTY - 1}")
        return cls(SalientTokensFormat.create(RATIO, dtype, block_size, num_kv_heads, head_size))

    @property
    def block_size(self) -> int:
        return self.slot_map.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.slot_map.dtype

    @property
    def k(self) -> MinMaxCodec:
        """K's codec, the grid both halves share: the heads and head size, as other formats give them."""
        return self.slot_map.k

    @property
    def quotas(self) -> tuple[int, ...]:
        """The slot map's: 4-bit tokens a block of n tokens keeps after a re-compression, n = 0 .. B."""
        return self.slot_map.quotas

    @property
    def rows(self) -> int:
        """Rows of each half a block and head: B / 2."""
        return self.block_size // 2

    def half_codec(self, bits: int) -> MinMaxCodec:
        """V's codec of one half, whose per-token layout the half's V rows take."""
        fmt = self.slot_map
        return MinMaxCodec(bits, "token", False, self.rows, fmt.k.num_heads, fmt.k.head_size)

    @cached_property
    def regions(self) -> Regions:
        H, D, rows = self.k.num_heads, self.k.head_size, self.rows
        regions = [("k_scale", H * D * 2), ("k_zero", H * D * 2)]
        for bits, half in _HALVES:
            codes = H * rows * packed_row_bytes(D, bits)
            regions += [(f"k{half}", codes), (f"v{half}", codes), (f"v{half}_scale", H * rows * 2),
                        (f"v{half}_zero", H * rows * 2)]
        return Regions(regions + [("place_of", H * self.block_size)])

    # --- torch reference -------------------------------------------------------------------------

    def place_of(self, pages: torch.Tensor) -> torch.Tensor:
        """[N, B, H] int64: each row's place in its block (rows 0..B/2-1 the 4-bit half), EMPTY for none."""
        H, B = self.k.num_heads, self.block_size
        return self.regions.view(pages, "place_of", torch.uint8, (H, B)).transpose(1, 2).long()

    def to_slot_map(self, pages: torch.Tensor) -> torch.Tensor:
        """The slot-map pages (``SalientTokensFormat`` at r = 0.5) of the same tokens; tokens no row
        holds read as 2-bit zeros."""
        fmt, N = self.slot_map, pages.shape[0]
        B, H, D, rows = self.block_size, fmt.k.num_heads, fmt.k.head_size, self.rows
        place = self.place_of(pages)
        to = torch.where(place != EMPTY, place, B)
        out = torch.zeros(N, fmt.page_bytes, dtype=torch.uint8, device=pages.device)
        for s in ("scale", "zero"):
            fmt.regions.write(out, f"k_{s}", self.regions.view(pages, f"k_{s}", _F16, (H, D)))
        for name, st in self.row_stats(pages).items():
            fmt.regions.write(out, name, _moved(st, to).transpose(1, 2))
        in_4_bits = (torch.arange(B, device=pages.device) < rows)[None, :, None].expand(N, B, H)
        fmt._write_codes(out, {name: _moved(c, to) for name, c in self.row_codes(pages).items()},
                         _moved(in_4_bits, to))
        return out

    def from_slot_map(self, slot_pages: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
        """Pages of the tokens 0..filled-1 [N] of slot-map pages: a salient token's row its slot, the
        others the 2-bit half's rows in token order."""
        fmt, N = self.slot_map, slot_pages.shape[0]
        B, H, D, rows = self.block_size, fmt.k.num_heads, fmt.k.head_size, self.rows
        dev = slot_pages.device
        token = torch.arange(B, device=dev)[None, :, None].expand(N, B, H)
        written = token < filled[:, None, None]
        slot = fmt.regions.view(slot_pages, "slot_of", torch.uint8, (H, B)).transpose(1, 2).long()
        salient = (slot != NO_SLOT) & written
        plain = written & ~salient
        if N and max(int(plain.sum(1).amax()), int(salient.sum(1).amax())) > rows:
            raise ValueError(f"split rows: more than {rows} tokens of one precision in a block and head")
        row = torch.where(salient, slot, rows + plain.long().cumsum(1) - 1)
        row = torch.where(written, row, B)  # [N, B tokens, H]; unwritten ones dropped
        codes = {name: _moved(fmt._codes(slot_pages, name), row) for name in ("k", "v")}
        v_stats = {f"v_{s}": _moved(fmt.regions.view(slot_pages, f"v_{s}", _F16, (H, B)).transpose(1, 2), row)
                   for s in ("scale", "zero")}
        k_grid = {f"k_{s}": fmt.regions.view(slot_pages, f"k_{s}", _F16, (H, D)) for s in ("scale", "zero")}
        return self.pack_rows(codes, v_stats, _moved(token, row, EMPTY), k_grid)

    def pack_rows(self, codes: dict[str, torch.Tensor], v_stats: dict[str, torch.Tensor], place: torch.Tensor,
                  k_grid: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pages from their rows: ``codes`` "k", "v" [N, B rows, H, D] 4-bit codes (a 2-bit row's top two
        bits kept), ``v_stats`` "v_scale", "v_zero" [N, B rows, H], ``place`` [N, B rows, H] (EMPTY:
        none) and ``k_grid`` "k_scale", "k_zero" [N, H, D] (float16)."""
        rows = self.rows
        out = torch.zeros(place.shape[0], self.page_bytes, dtype=torch.uint8, device=place.device)
        for name, grid in k_grid.items():
            self.regions.write(out, name, grid)
        self.regions.write(out, "place_of", place.to(torch.uint8).transpose(1, 2))
        for name, by_row in codes.items():
            for (bits, half), part in zip(_HALVES, (by_row[:, :rows], by_row[:, rows:] >> REFINE_BITS)):
                packed = pack(part, bits)  # [N, rows, H, R]
                if name == "k":
                    self.regions.write(out, f"k{half}", packed.transpose(1, 2))
                else:
                    self.regions.write(out, f"v{half}", self.half_codec(bits)._codes_to_page(packed))
        for name, by_row in v_stats.items():
            _, s = name.split("_")
            self.regions.write(out, f"v4_{s}", by_row[:, :rows].transpose(1, 2))
            self.regions.write(out, f"v2_{s}", by_row[:, rows:].transpose(1, 2))
        return out

    def salient(self, pages: torch.Tensor) -> torch.Tensor:
        """[N, B, H] bool: the token keeps 4-bit codes."""
        return self.slot_map.salient(self.to_slot_map(pages))

    def decode(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pages [N, page_bytes] -> k, v float32 [N, B, H, D] by token (tokens no row holds read as 0)."""
        H, D = self.k.num_heads, self.k.head_size
        place = self.place_of(pages)
        to = torch.where(place != EMPTY, place, self.block_size)
        codes, stats = self.row_codes(pages), self.row_stats(pages)
        middle = torch.where(torch.arange(self.block_size, device=pages.device) < self.rows, 0.0, MIDDLE)
        levels = {name: c + middle[None, :, None, None] for name, c in codes.items()}
        k = levels["k"] * self.regions.view(pages, "k_scale", _F16, (1, H, D)).float() \
            + self.regions.view(pages, "k_zero", _F16, (1, H, D)).float()
        v = levels["v"] * stats["v_scale"].float()[..., None] + stats["v_zero"].float()[..., None]
        return _moved(k, to), _moved(v, to)

    # --- byte layout ------------------------------------------------------------------------------

    def row_codes(self, pages: torch.Tensor) -> dict[str, torch.Tensor]:
        """K's and V's codes [N, B rows, H, D] int64 on the 4-bit grid: a 4-bit row's whole, a 2-bit row's 4 c."""
        H, D, rows = self.k.num_heads, self.k.head_size, self.rows
        out = {}
        for name in ("k", "v"):
            halves = []
            for bits, half in _HALVES:
                if name == "k":
                    packed = self.regions.view(pages, f"k{half}", torch.uint8, (H, rows, packed_row_bytes(D, bits)))
                    codes = unpack(packed.transpose(1, 2), bits, D)
                else:
                    codec = self.half_codec(bits)
                    codes = codec._page_codes(self._codec_page(pages, codec, f"v{half}"))
                halves.append(codes.long() << (HIGH_BITS - bits))
            out[name] = torch.cat(halves, 1)
        return out

    def row_stats(self, pages: torch.Tensor) -> dict[str, torch.Tensor]:
        """V's scale and zero [N, B rows, H] float16, the 4-bit half's rows first."""
        H, rows = self.k.num_heads, self.rows
        return {f"v_{s}": torch.cat([self.regions.view(pages, f"v{half}_{s}", _F16, (H, rows)).transpose(1, 2)
                                     for _, half in _HALVES], 1) for s in ("scale", "zero")}

    def _codec_page(self, pages: torch.Tensor, codec: MinMaxCodec, region: str) -> torch.Tensor:
        """A codec page holding a half's V codes (its statistics left 0: only the codes are read)."""
        out = torch.zeros(pages.shape[0], codec.nbytes, dtype=torch.uint8, device=pages.device)
        start, size = self.regions.offsets[region]
        codec.regions.write(out, "codes", pages[:, start:start + size])
        return out


def _moved(x: torch.Tensor, to: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """``x`` [N, B, H, ...] with entry b of each (n, h) moved to place ``to`` [N, B, H] (B: dropped),
    ``fill`` where none goes."""
    N, B = x.shape[:2]
    out = torch.full((N, B + 1, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    index = to.reshape(*to.shape, *[1] * (x.dim() - 3)).expand_as(x)
    return out.scatter_(1, index, x)[:, :B]
