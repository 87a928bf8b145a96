"""Where each region of a page lies: the one source of byte offsets and group sizes.

The torch reference (``codecs``, ``page``) reads and writes pages through ``Regions``; the Triton
kernels take ``page_layout(fmt)``'s offsets as compile-time constants; the CUDA kernels take the
same offsets as launch arguments and ``KERNEL_CONSTANTS`` as build flags (``cuda_jit``), so no
kernel source states an offset or a group size of its own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .page import KVPageFormat

REGION_ALIGN = 16  # bytes: every region starts on a 16-byte boundary (the kernels' vector loads)
# Tokens of a group of 2-, 3- and 4-bit codes with statistics per token (``MinMaxCodec.token_group``):
# a decoding token's write touches a quarter of the 128-byte lines it would touch with the block's
# tokens together, and a warp's loads of 16 tokens a lane still cover whole lines (docs/formats.md).
TOKEN_GROUP = 32
TOKEN_GROUP_BITS = (2, 3, 4)


class Regions:
    """Named byte regions laid end to end, each aligned to ``REGION_ALIGN`` bytes."""

    def __init__(self, regions: list[tuple[str, int]]):
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for name, size in regions:
            self.offsets[name] = (pos, size)
            pos += -(-size // REGION_ALIGN) * REGION_ALIGN
        self.nbytes = pos

    def start(self, name: str) -> int:
        return self.offsets[name][0]

    def view(self, pages: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        start, size = self.offsets[name]
        raw = pages[:, start:start + size].contiguous()
        return raw.view(dtype).reshape(pages.shape[0], *shape)

    def write(self, pages: torch.Tensor, name: str, value: torch.Tensor) -> None:
        start, size = self.offsets[name]
        pages[:, start:start + size] = value.contiguous().view(torch.uint8).reshape(pages.shape[0], size)


def slot_bytes(nbytes: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes per token slot as vLLM sees a page of ``nbytes``: ``block_size`` equal slots, each a
    whole number of the model dtype's elements."""
    per_slot = -(-nbytes // block_size)
    return -(-per_slot // dtype.itemsize) * dtype.itemsize


class SlottedPage:
    """A page laid out by its ``regions`` (a ``Regions``), seen by vLLM as ``block_size`` equal slots
    of ``dtype`` elements (formats over other layouts than ``KVPageFormat``'s)."""

    @functools.cached_property
    def slot_bytes(self) -> int:
        return slot_bytes(self.regions.nbytes, self.block_size, self.dtype)

    @functools.cached_property
    def page_bytes(self) -> int:
        return self.slot_bytes * self.block_size


@dataclass(frozen=True)
class TensorLayout:
    """One tensor's (K's or V's) regions, as offsets from the start of the page."""
    bits: int          # 16: raw values in the model dtype
    codes: int         # offset of codes (or raw values)
    row_bytes: int     # bytes of one (token, head) row of codes
    scale: int = 0
    zero: int = 0
    channel_scale: int = -1  # -1: none
    # statistics per token: tokens whose codes of one byte lie together (MinMaxCodec.token_group);
    # 0: statistics per channel (or raw values), rows head-major
    token_group: int = 0


@dataclass(frozen=True)
class PageLayout:
    k: TensorLayout
    v: TensorLayout | None  # None: K-only pages
    page_bytes: int
    block_size: int
    num_kv_heads: int
    head_size: int


@functools.cache
def page_layout(fmt: KVPageFormat) -> PageLayout:
    """The offsets every kernel reads ``fmt``'s pages with (each codec places its own regions; a
    format over regions of its own gives its ``kernel_layout``)."""
    if hasattr(fmt, "kernel_layout"):
        return fmt.kernel_layout()
    v = None if fmt.v is None else fmt.v.tensor_layout(fmt.k.nbytes)
    return PageLayout(fmt.k.tensor_layout(0), v, fmt.page_bytes, fmt.block_size, fmt.k.num_heads, fmt.k.head_size)
