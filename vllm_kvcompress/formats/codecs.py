"""Codecs: how one tensor (K or V) of a block of tokens is stored in bytes.

A codec turns ``x`` of shape ``[N, B, H, D]`` (N blocks, B token slots, H KV heads,
D head size) into ``[N, nbytes]`` uint8 and back. ``num_valid[n]`` says how many
leading token slots of block n hold real tokens; statistics (min/max, channel
scales) are taken over those slots only. This module is pure torch: it is the
reference that the backend and the kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, Literal, Protocol

import torch

from .layout import TOKEN_GROUP, TOKEN_GROUP_BITS, Regions, TensorLayout
from .packing import pack, packed_row_bytes, unpack

Axis = Literal["channel", "token"]
_SCALE_DTYPE = torch.float16
EPS = 1e-6  # the smallest scale
# A widened K channel's grid reaches this share of its span further out on each side its new values
# passed, so that the next tokens of a drifting channel fit it (docs/formats.md: on a real model's
# keys at 4 bits, 48% fewer rows re-encoded and a smaller error than the bare span). A power of two,
# so that the product is exact and an FMA in a kernel rounds as the reference does.
WIDEN_MARGIN = 0.125
# ``MinMaxCodec.clip``: a channel's grid spans its values' range shrunk about its middle by the one
# of these ratios whose codes have the least squared error over the block (the first of equals),
# each value's error weighted by its squared distance from the middle: the few large values that
# attention turns on are not traded for the many small ones (plain squared error cost Gemma 3 twice as
# much, docs/formats.md). 1 - k / CLIP_DENOMINATOR, k = 0 .. CLIP_DENOMINATOR / 2, exact in float32 as
# in a kernel's constants. At 3 and 4 bits clipping costs (docs/formats.md).
CLIP_DENOMINATOR = 16
CLIP_RATIOS = tuple(1 - k / CLIP_DENOMINATOR for k in range(CLIP_DENOMINATOR // 2 + 1))


def min_max_grid(lo: torch.Tensor, hi: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 zero and scale (as float32) of the grid spanning ``lo .. hi`` with codes 0 .. ``top``.
    ``top`` divides as a tensor: torch on a GPU multiplies by the reciprocal of a number, one rounding
    more than the kernels' IEEE division, which moves some scales by a float16 step."""
    zero = lo.to(_SCALE_DTYPE).float()
    span = hi - zero
    return zero, (span / torch.full_like(span, top)).clamp_min(EPS).to(_SCALE_DTYPE).float()


def codes_on(x: torch.Tensor, zero: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Unclamped codes of ``x`` on the grid ``zero + k * step``, rounded half up (as the kernels do)."""
    return torch.floor((x - zero) / step + 0.5)


def min_max_codes(x: torch.Tensor, zero: torch.Tensor, step: torch.Tensor, top: float) -> torch.Tensor:
    """int32 codes of ``x`` on the grid ``zero + k * step`` (``codes_on``), clamped to 0 .. ``top``."""
    return codes_on(x, zero, step).clamp_(min=0).clamp_(max=top).to(torch.int32)


def widened_span(lo: torch.Tensor, hi: torch.Tensor, zero: torch.Tensor, grid_top: torch.Tensor):
    """The bounds a widened channel's grid spans: its stored grid ``zero .. grid_top`` and its new
    values ``lo .. hi``, moved out by ``WIDEN_MARGIN`` of that span on each side the new values pass
    (a side they don't pass stays where it is)."""
    a, b = torch.minimum(lo, zero), torch.maximum(hi, grid_top)
    margin = (b - a) * WIDEN_MARGIN
    return torch.where(lo < zero, a - margin, a), torch.where(hi > grid_top, b + margin, b)


def _valid_mask(num_valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, B] bool: slot b of block n holds a token."""
    return torch.arange(block_size, device=num_valid.device)[None, :] < num_valid[:, None]


class Codec(Protocol):
    """What a page format needs of a codec: its size, its torch reference, and where its regions lie
    (``tensor_layout``, which every kernel reads). New codecs register with ``register_codec``."""

    name: ClassVar[str]
    bits: int
    block_size: int
    num_heads: int
    head_size: int

    @property
    def nbytes(self) -> int: ...

    def encode(self, x: torch.Tensor, num_valid: torch.Tensor, stored: torch.Tensor | None = None,
               num_stored: torch.Tensor | None = None) -> torch.Tensor: ...

    def decode(self, pages: torch.Tensor) -> torch.Tensor: ...

    def tensor_layout(self, base: int) -> TensorLayout: ...


@dataclass(frozen=True)
class TensorSpec:
    """How one tensor (K or V) of a layer is stored, as a config states it."""
    bits: int
    axis: Axis = "channel"
    channel_scaling: bool = False
    codec: str | None = None  # a registered codec's name (None: raw at 16 bits, min-max below)
    clip: bool = False  # min-max grids per channel narrowed to the least squared error (``MinMaxCodec``)

    @property
    def codec_name(self) -> str:
        if self.codec is not None:
            return self.codec
        return UncompressedCodec.name if self.bits == 16 else MinMaxCodec.name


CODECS: dict[str, type] = {}


def register_codec(cls: type) -> type:
    """Make ``cls`` (a ``Codec`` with a ``from_spec`` constructor) available under ``cls.name``."""
    CODECS[cls.name] = cls
    return cls


def make_codec(spec: TensorSpec, dtype: torch.dtype, block_size: int, num_heads: int, head_size: int) -> Codec:
    name = spec.codec_name
    if name not in CODECS:
        raise ValueError(f"codec {name!r} is not registered (registered: {', '.join(sorted(CODECS))})")
    return CODECS[name].from_spec(spec, dtype, block_size, num_heads, head_size)


@register_codec
@dataclass(frozen=True)
class UncompressedCodec:
    """Uncompressed: the model's own values, in its dtype ("16 bits" in configs)."""

    dtype: torch.dtype
    block_size: int
    num_heads: int
    head_size: int

    name: ClassVar[str] = "raw"
    bits = 16

    @classmethod
    def from_spec(cls, spec: TensorSpec, dtype: torch.dtype, block_size: int, num_heads: int,
                  head_size: int) -> "UncompressedCodec":
        return cls(dtype, block_size, num_heads, head_size)

    @property
    def nbytes(self) -> int:
        return self.block_size * self.num_heads * self.head_size * self.dtype.itemsize

    def encode(self, x: torch.Tensor, num_valid: torch.Tensor, stored: torch.Tensor | None = None,
               num_stored: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as ``MinMaxCodec.encode``; values are kept as they are, so an append
        needs nothing from the stored bytes."""
        mask = _valid_mask(num_valid, self.block_size)[:, :, None, None]
        y = torch.where(mask, x, 0).to(self.dtype)
        return y.contiguous().view(torch.uint8).reshape(x.shape[0], self.nbytes)

    def decode(self, pages: torch.Tensor) -> torch.Tensor:
        y = pages.contiguous().view(self.dtype)
        return y.reshape(pages.shape[0], self.block_size, self.num_heads, self.head_size).float()

    def tensor_layout(self, base: int) -> TensorLayout:
        return TensorLayout(16, base, self.head_size * self.dtype.itemsize)


@register_codec
@dataclass(frozen=True)
class MinMaxCodec:
    """Asymmetric min-max integer quantization, packed.

    ``axis="channel"`` (KIVI's K): one scale and zero per (head, channel), taken
    over the block's tokens. ``axis="token"`` (KIVI's V): one per (token, head),
    taken over the channels. ``channel_scaling`` (ZipCache's channel-separable
    V) divides each channel by ``sqrt(max |x|)`` over the block before
    quantizing and multiplies it back after. Scales and zeros are float16.

    Codes are packed along channels into bytes (``packing``; 3 bits as two
    planes, the low two bits then the high bit). With statistics per channel
    a page stores them row by row, head-major ``[H, B, R]`` (R bytes a row): a
    head's block of rows lies together, so re-encoding a channel reads and
    writes one stretch of memory; with statistics per token, in groups of G =
    ``token_group`` tokens, byte-major within a group ``[H, B / G, R, G]``: a
    byte's codes of G consecutive tokens lie together, the order the decode
    kernels' product over tokens (``p . V``) consumes, and a token's bytes lie
    within one group's ``R x G`` bytes, so a decoding token's write touches fewer of the
    page's 128-byte lines (docs/formats.md).
    """

    bits: int
    axis: Axis
    channel_scaling: bool
    block_size: int
    num_heads: int
    head_size: int
    clip: bool = False  # per-channel grids narrowed on a block's first write (CLIP_RATIOS)

    name: ClassVar[str] = "minmax"

    def __post_init__(self):
        if self.clip and (self.axis != "channel" or self.channel_scaling):
            raise ValueError("clip narrows grids per channel, without channel scaling")

    @classmethod
    def from_spec(cls, spec: TensorSpec, dtype: torch.dtype, block_size: int, num_heads: int,
                  head_size: int) -> "MinMaxCodec":
        return cls(spec.bits, spec.axis, spec.channel_scaling, block_size, num_heads, head_size, spec.clip)

    @property
    def token_group(self) -> int:
        """Tokens whose codes of one byte lie together where statistics are per token:
        ``TOKEN_GROUP`` at 2, 3 and 4 bits where it divides the block, else the whole block (8-bit
        codes: the Triton kernel, which decodes them, reads grouped ones 4 to 9% slower)."""
        grouped = self.bits in TOKEN_GROUP_BITS and self.block_size % TOKEN_GROUP == 0
        return TOKEN_GROUP if grouped else self.block_size

    @cached_property  # read by every kernel launch (page offsets)
    def regions(self) -> Regions:
        B, H, D = self.block_size, self.num_heads, self.head_size
        stat_shape = H * D if self.axis == "channel" else B * H
        regions = [("codes", B * H * packed_row_bytes(D, self.bits)),
                   ("scale", stat_shape * 2), ("zero", stat_shape * 2)]
        if self.channel_scaling:
            regions.append(("channel_scale", H * D * 2))
        return Regions(regions)

    @property
    def nbytes(self) -> int:
        return self.regions.nbytes

    def tensor_layout(self, base: int) -> TensorLayout:
        at = self.regions.start
        return TensorLayout(self.bits, base + at("codes"), packed_row_bytes(self.head_size, self.bits),
                            base + at("scale"), base + at("zero"),
                            base + at("channel_scale") if self.channel_scaling else -1,
                            self.token_group if self.axis == "token" else 0)

    @property
    def top(self) -> float:
        """The highest code."""
        return float((1 << self.bits) - 1)

    def _stat_dims(self) -> tuple[int, ...]:
        return (1,) if self.axis == "channel" else (3,)

    def encode(self, x: torch.Tensor, num_valid: torch.Tensor, stored: torch.Tensor | None = None,
               num_stored: torch.Tensor | None = None) -> torch.Tensor:
        """Encode blocks ``x``. With ``stored`` (the blocks' bytes before an append) and ``num_stored``
        (how many leading tokens they hold; the rest up to ``num_valid`` are new), statistics per
        channel follow the append rule: a channel whose new values all round onto its stored grid
        (codes 0..top) keeps its statistics and its earlier codes, and only the new tokens are
        encoded; any other channel widens (``widened_span``) to span its stored grid (zero .. zero +
        scale * top) and its new values, with a margin beyond each side the new values passed, and all
        its tokens are coded on the widened grid."""
        N, B, H, D = x.shape
        x = x.float()
        mask = _valid_mask(num_valid, B)[:, :, None, None]
        layout = self.regions
        pages = torch.zeros(N, layout.nbytes, dtype=torch.uint8, device=x.device)
        if self.channel_scaling:
            # sqrt in float64: some CPU builds of torch round float32 sqrt inexactly; kernels use IEEE sqrt
            c = torch.where(mask, x.abs(), 0).amax(dim=1).clamp_min(EPS).double().sqrt().float().to(_SCALE_DTYPE)
            layout.write(pages, "channel_scale", c)
            x = x / c.float()[:, None]
        appending = stored is not None and self.axis == "channel" and not self.channel_scaling
        stat_rows = mask
        if appending:
            earlier = torch.arange(B, device=x.device)[None, :, None, None] < num_stored[:, None, None, None]
            stat_rows = mask & ~earlier
        dims = self._stat_dims()
        mn = torch.where(stat_rows, x, float("inf")).amin(dim=dims, keepdim=True)
        mx = torch.where(stat_rows, x, float("-inf")).amax(dim=dims, keepdim=True)
        if appending:
            # a widened channel spans its stored grid and its new values: the earlier rows need not be
            # read for the statistics, only requantized (see docs/formats.md)
            has_stored = (num_stored > 0)[:, None, None, None]
            old_zero, old_scale = self._stats_from_page(stored, "zero"), self._stats_from_page(stored, "scale")
            lo, hi = widened_span(mn, mx, old_zero, old_zero + old_scale * self.top)
            mn, mx = torch.where(has_stored, lo, mn), torch.where(has_stored, hi, mx)
        mn = torch.where(torch.isfinite(mn), mn, 0)
        mx = torch.where(torch.isfinite(mx), mx, 0)
        if self.clip:  # on a block's first write of two tokens or more; an append widens as without
            searched = stat_rows.sum(1, keepdim=True) > 1  # (one value keeps its plain grid at every ratio)
            if appending:
                searched = searched & ~has_stored
            if searched.any():
                lo, hi = self._least_error_span(x, stat_rows, mn, mx)
                mn, mx = torch.where(searched, lo, mn), torch.where(searched, hi, mx)
        zero, scale = min_max_grid(mn, mx, self.top)
        keep = None
        if appending:
            keep = self._grid_kept(x, stat_rows, old_zero, old_scale) & has_stored
            zero = torch.where(keep, old_zero, zero)
            scale = torch.where(keep, old_scale, scale)
        codes = min_max_codes(x, zero, scale, self.top)
        if keep is not None:
            codes = torch.where(keep & earlier, self._page_codes(stored), codes)
        codes = torch.where(mask, codes, 0)
        layout.write(pages, "codes", self._codes_to_page(pack(codes, self.bits)))
        layout.write(pages, "scale", self._stats_to_page(scale))
        layout.write(pages, "zero", self._stats_to_page(zero))
        return pages

    def _least_error_span(self, x: torch.Tensor, rows: torch.Tensor, mn: torch.Tensor,
                          mx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per channel, ``mn .. mx`` shrunk about its middle by the ratio of CLIP_RATIOS whose grid
        codes the channel's ``rows`` of ``x`` with the least weighted squared error (ratio 1: ``mn ..
        mx``), each value's error weighted by its squared distance from the middle (CLIP_RATIOS)."""
        mid, half = (mn + mx) * 0.5, (mx - mn) * 0.5
        spread = (x - mid) ** 2  # each value's weight, the same at every ratio
        best_lo, best_hi, least = mn, mx, torch.full_like(mn, float("inf"))
        for ratio in CLIP_RATIOS:
            lo, hi = (mn, mx) if ratio == 1.0 else (mid - ratio * half, mid + ratio * half)
            zero, step = min_max_grid(lo, hi, self.top)
            coded = min_max_codes(x, zero, step, self.top) * step + zero
            error = torch.where(rows, (coded - x) ** 2 * spread, 0).sum(1, keepdim=True)  # unwritten rows: NaN
            better = error < least
            least = torch.where(better, error, least)
            best_lo, best_hi = torch.where(better, lo, best_lo), torch.where(better, hi, best_hi)
        return best_lo, best_hi

    def _grid_kept(self, x: torch.Tensor, new: torch.Tensor, zero: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """[N, 1, H, D] bool: every ``new`` value of the channel rounds onto its stored grid."""
        q = codes_on(x, zero, step)
        return torch.where(new, (q >= 0) & (q <= self.top), True).all(dim=1, keepdim=True)

    def _codes_to_page(self, rows: torch.Tensor) -> torch.Tensor:
        """Packed rows [N, B, H, R] as stored (see the class docstring)."""
        if self.axis == "channel":
            return rows.transpose(1, 2)
        N, B, H, R = rows.shape
        g = self.token_group
        return rows.reshape(N, B // g, g, H, R).permute(0, 3, 1, 4, 2)

    def _page_codes(self, pages: torch.Tensor) -> torch.Tensor:
        """[N, B, H, D] int32 codes of pages."""
        B, H, D = self.block_size, self.num_heads, self.head_size
        R = packed_row_bytes(D, self.bits)
        if self.axis == "channel":
            rows = self.regions.view(pages, "codes", torch.uint8, (H, B, R)).transpose(1, 2)
        else:
            g = self.token_group
            units = self.regions.view(pages, "codes", torch.uint8, (H, B // g, R, g))
            rows = units.permute(0, 2, 4, 1, 3).reshape(pages.shape[0], B, H, R)
        return unpack(rows, self.bits, D)

    def _stats_to_page(self, stat: torch.Tensor) -> torch.Tensor:
        """Statistics as stored: per channel [H, D]; per token head-major [H, B], so that one head's
        statistics for a block lie together (a decode kernel reads one head at a time)."""
        stat = stat.to(_SCALE_DTYPE)
        return stat if self.axis == "channel" else stat.transpose(1, 2)

    def _stats_from_page(self, pages: torch.Tensor, name: str) -> torch.Tensor:
        """Back to [N, 1, H, D] (per channel) or [N, B, H, 1] (per token), float32."""
        B, H, D = self.block_size, self.num_heads, self.head_size
        if self.axis == "channel":
            return self.regions.view(pages, name, _SCALE_DTYPE, (1, H, D)).float()
        return self.regions.view(pages, name, _SCALE_DTYPE, (H, B, 1)).transpose(1, 2).float()

    def decode(self, pages: torch.Tensor) -> torch.Tensor:
        H, D = self.num_heads, self.head_size
        layout = self.regions
        codes = self._page_codes(pages).float()
        scale = self._stats_from_page(pages, "scale")
        zero = self._stats_from_page(pages, "zero")
        x = codes * scale + zero
        if self.channel_scaling:
            x = x * layout.view(pages, "channel_scale", _SCALE_DTYPE, (1, H, D)).float()
        return x
