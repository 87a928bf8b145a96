"""ZipCache: a page where a fixed share of each block's tokens keep 4-bit codes and the rest 2-bit ones.

Both precisions share one grid: K's 4-bit min-max grid per channel over the block, V's per token.
Every token keeps the top 2 bits of its 4-bit code (the high plane); a salient token also keeps the
low 2 bits in one of the block's ``slots`` refinement rows, which ``slot_of`` points to (per KV head:
each head keeps the tokens it attends to). A token without refinement reads as the middle of its
four sub-levels (code ``4 hi + 1.5``), which is the nearest 2-bit level: a 2-bit grid of step
``4 s`` with levels ``1.5 s`` inside the range's ends (a min-max 2-bit grid has step ``5 s`` and
levels at the ends; for values spread evenly its largest error is 2.5 steps against 2 here).
Dropping a token to 2 bits only clears its slot: its high bits stay as they are.

Page: K scale, zero [H, D] | V scale, zero [H, B] (float16) | K high [H, B, D/4] | V high [H, B, D/4]
| K low [H, R, D/4] | V low [H, R, D/4] (uint8, 2-bit codes packed along channels) | slot_of [H, B]
uint8 (``NO_SLOT``: 2 bits). Which tokens are salient is decided by the writer (``salient_torch``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from .codecs import MinMaxCodec, TensorSpec
from .layout import PageLayout, Regions, SlottedPage, TensorLayout
from .packing import pack, packed_row_bytes, unpack

HIGH_BITS, LOW_BITS = 4, 2
REFINE_BITS = HIGH_BITS - LOW_BITS
NO_SLOT = 255
MIDDLE = ((1 << REFINE_BITS) - 1) / 2  # a 2-bit token's place among its four 4-bit sub-levels
_F16 = torch.float16


@dataclass(frozen=True)
class SalientTokensFormat(SlottedPage):
    k: MinMaxCodec  # 4 bits, statistics per channel: the grid and append rule both precisions share
    v: MinMaxCodec  # 4 bits, statistics per token
    block_size: int
    dtype: torch.dtype
    ratio: float  # share of a block's tokens with 4-bit codes

    @classmethod
    def create(cls, ratio: float, dtype: torch.dtype, block_size: int, num_kv_heads: int,
               head_size: int) -> "SalientTokensFormat":
        shape = (block_size, num_kv_heads, head_size)
        k = MinMaxCodec.from_spec(TensorSpec(HIGH_BITS, "channel"), dtype, *shape)
        v = MinMaxCodec.from_spec(TensorSpec(HIGH_BITS, "token"), dtype, *shape)
        return cls(k, v, block_size, dtype, ratio)

    @property
    def slots(self) -> int:
        """Refinement rows a block holds per KV head (its 4-bit tokens at most)."""
        return math.ceil(self.ratio * self.block_size - 1e-9)

    def quota(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """4-bit tokens a block of ``num_tokens`` keeps after a re-compression."""
        return torch.ceil(self.ratio * num_tokens.double() - 1e-9).long().clamp(max=self.slots)

    @cached_property
    def quotas(self) -> tuple[int, ...]:
        """``quota`` of a block of n tokens, n = 0 .. block_size (what a step's plan looks up on the host)."""
        return tuple(self.quota(torch.arange(self.block_size + 1)).tolist())

    @cached_property
    def regions(self) -> Regions:
        B, H, D, R = self.block_size, self.k.num_heads, self.k.head_size, self.slots
        row = packed_row_bytes(D, LOW_BITS)
        return Regions([("k_scale", H * D * 2), ("k_zero", H * D * 2), ("v_scale", H * B * 2), ("v_zero", H * B * 2),
                        ("k_high", H * B * row), ("v_high", H * B * row), ("k_low", H * R * row),
                        ("v_low", H * R * row), ("slot_of", H * B)])

    def kernel_layout(self) -> PageLayout:
        """The pages as the decode kernel reads them (``layout.page_layout``): the high planes as
        2-bit codes with the 4-bit grid's statistics, each level 4 of the grid's steps; the kernel
        adds the refinement rows (``triton_kernels.decode``, SALIENT)."""
        at, row = self.regions.start, packed_row_bytes(self.k.head_size, LOW_BITS)
        k = TensorLayout(LOW_BITS, at("k_high"), row, at("k_scale"), at("k_zero"))
        v = TensorLayout(LOW_BITS, at("v_high"), row, at("v_scale"), at("v_zero"))
        return PageLayout(k, v, self.page_bytes, self.block_size, self.k.num_heads, self.k.head_size)

    def dense_page_bytes(self) -> int:
        return 2 * self.block_size * self.k.num_heads * self.k.head_size * self.dtype.itemsize

    # --- torch reference -------------------------------------------------------------------------

    def salient(self, pages: torch.Tensor) -> torch.Tensor:
        """[N, B, H] bool: the token keeps 4-bit codes."""
        B, H = self.block_size, self.k.num_heads
        return self.regions.view(pages, "slot_of", torch.uint8, (H, B)).transpose(1, 2) != NO_SLOT

    def decode(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pages [N, page_bytes] -> k, v float32 [N, B, H, D]."""
        B, H, D = self.block_size, self.k.num_heads, self.k.head_size
        salient = self.salient(pages)[..., None]
        out = []
        for name, axis_shape in (("k", (1, H, D)), ("v", (H, B, 1))):
            high, low = self._planes(pages, name)
            codes = (high << REFINE_BITS).float() + torch.where(salient, low.float(), MIDDLE)
            scale, zero = (self.regions.view(pages, f"{name}_{s}", _F16, axis_shape).float() for s in ("scale", "zero"))
            if name == "v":
                scale, zero = scale.transpose(1, 2), zero.transpose(1, 2)
            out.append(codes * scale + zero)
        return out[0], out[1]

    def encode(self, k: torch.Tensor, v: torch.Tensor, num_valid: torch.Tensor, salient: torch.Tensor,
               stored: torch.Tensor | None = None, num_stored: torch.Tensor | None = None) -> torch.Tensor:
        """k, v [N, B, H, D]; ``salient`` [N, B, H] bool (at most ``slots`` a block and head) -> pages.

        With ``stored`` (the pages before an append) and ``num_stored`` (tokens they held), K follows
        the 4-bit codec's append rule on the shared grid (a 2-bit token's earlier codes keep their high
        bits, or are requantized from the level they read as where the channel widens), and V's
        earlier tokens keep their codes and statistics as they are."""
        N, B, H, D = k.shape
        valid = torch.arange(B, device=k.device)[None, :] < num_valid[:, None]
        salient = salient & valid[..., None]
        if salient.numel() and int(salient.sum(dim=1).amax()) > self.slots:
            raise ValueError(f"more than {self.slots} salient tokens in a block and head")
        pages = torch.zeros(N, self.page_bytes, dtype=torch.uint8, device=k.device)
        k_page = self.k.encode(k, num_valid, None if stored is None else self._as_codec_page(stored, "k"), num_stored)
        codes = {"k": self.k._page_codes(k_page)}
        for s in ("scale", "zero"):
            self.regions.write(pages, f"k_{s}", self.k.regions.view(k_page, s, _F16, (H, D)))
        v_page = self.v.encode(v, num_valid)
        v_codes = self.v._page_codes(v_page)
        v_stats = {s: self.v.regions.view(v_page, s, _F16, (H, B)) for s in ("scale", "zero")}
        if stored is not None:  # earlier tokens' V as stored: statistics per token need no update
            earlier = torch.arange(B, device=k.device)[None, :] < num_stored[:, None]
            v_codes = torch.where(earlier[..., None, None], self._codes(stored, "v"), v_codes)
            for s in ("scale", "zero"):
                old = self.regions.view(stored, f"v_{s}", _F16, (H, B))
                v_stats[s] = torch.where(earlier[:, None, :], old, v_stats[s])
        codes["v"] = v_codes
        for s in ("scale", "zero"):
            self.regions.write(pages, f"v_{s}", v_stats[s])
        self._write_codes(pages, codes, salient)
        return pages

    def demote(self, pages: torch.Tensor, salient: torch.Tensor) -> torch.Tensor:
        """``pages`` with only the tokens ``salient`` [N, B, H] (a subset of theirs) keeping 4 bits."""
        out = pages.clone()
        self._write_codes(out, {name: self._codes(pages, name) for name in ("k", "v")}, salient & self.salient(pages))
        return out

    # --- byte layout ------------------------------------------------------------------------------

    def _write_codes(self, pages: torch.Tensor, codes: dict[str, torch.Tensor], salient: torch.Tensor) -> None:
        """Split 4-bit codes [N, B, H, D] into the high plane and the salient tokens' refinement rows."""
        N, B, H, D = codes["k"].shape
        R = self.slots
        rank = salient.long().cumsum(dim=1) - 1  # [N, B, H]: a salient token's slot, in token order
        slot_of = torch.where(salient, rank, NO_SLOT).to(torch.uint8)
        self.regions.write(pages, "slot_of", slot_of.transpose(1, 2))
        target = torch.where(salient, rank, R)  # 2-bit tokens go to a spare row that is dropped
        for name, c in codes.items():
            self.regions.write(pages, f"{name}_high", pack(c >> REFINE_BITS, LOW_BITS).transpose(1, 2))
            low = torch.zeros(N, R + 1, H, D, dtype=c.dtype, device=c.device)
            low.scatter_(1, target[..., None].expand(-1, -1, -1, D), c & ((1 << REFINE_BITS) - 1))
            self.regions.write(pages, f"{name}_low", pack(low[:, :R], REFINE_BITS).transpose(1, 2))

    def _high(self, pages: torch.Tensor, name: str) -> torch.Tensor:
        B, H, D = self.block_size, self.k.num_heads, self.k.head_size
        rows = self.regions.view(pages, f"{name}_high", torch.uint8, (H, B, packed_row_bytes(D, LOW_BITS)))
        return unpack(rows.transpose(1, 2), LOW_BITS, D)

    def _codes(self, pages: torch.Tensor, name: str) -> torch.Tensor:
        """[N, B, H, D] int32 4-bit codes; a 2-bit token's low bits read as 0."""
        high, low = self._planes(pages, name)
        return (high << REFINE_BITS) + low

    def _planes(self, pages: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, B, H, D] int32 high bits of every token, and the low bits of the salient ones (0 else)."""
        B, H, D, R = self.block_size, self.k.num_heads, self.k.head_size, self.slots
        rows = self.regions.view(pages, f"{name}_low", torch.uint8, (H, R, packed_row_bytes(D, REFINE_BITS)))
        low = unpack(rows.transpose(1, 2), REFINE_BITS, D)  # [N, R, H, D]
        slot = self.regions.view(pages, "slot_of", torch.uint8, (H, B)).transpose(1, 2).long()  # [N, B, H]
        salient = slot != NO_SLOT
        gathered = low.gather(1, torch.where(salient, slot, 0)[..., None].expand(-1, -1, -1, D))
        return self._high(pages, name), torch.where(salient[..., None], gathered, 0)

    def _as_codec_page(self, pages: torch.Tensor, name: str) -> torch.Tensor:
        """The 4-bit codec's page with these pages' codes and statistics (for its append rule)."""
        codec = getattr(self, name)
        out = torch.zeros(pages.shape[0], codec.nbytes, dtype=torch.uint8, device=pages.device)
        codec.regions.write(out, "codes", codec._codes_to_page(pack(self._codes(pages, name), HIGH_BITS)))
        shape = (self.k.num_heads, self.k.head_size) if codec.axis == "channel" else (self.k.num_heads, self.block_size)
        for s in ("scale", "zero"):
            codec.regions.write(out, s, self.regions.view(pages, f"{name}_{s}", _F16, shape))
        return out
