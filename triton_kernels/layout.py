"""Byte offsets of a page's regions, as compile-time constants for the kernels."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from vllm_kvcompress.formats import KVPageFormat, MinMaxCodec
from vllm_kvcompress.formats.packing import packed_row_bytes


@dataclass(frozen=True)
class TensorLayout:
    bits: int          # 16: raw values in the model dtype
    codes: int         # offset of codes (or raw values)
    row_bytes: int     # bytes of one (token, head) row of codes
    scale: int = 0
    zero: int = 0
    channel_scale: int = -1  # -1: none
    # statistics per token: tokens whose codes of one storage unit lie together (MinMaxCodec.token_group);
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


def _tensor_layout(codec, base: int) -> TensorLayout:
    if not isinstance(codec, MinMaxCodec):
        return TensorLayout(16, base, codec.head_size * codec.dtype.itemsize)
    off = codec._layout.offsets
    return TensorLayout(codec.bits, base + off["codes"][0], packed_row_bytes(codec.head_size, codec.bits),
                        base + off["scale"][0], base + off["zero"][0],
                        base + off["channel_scale"][0] if codec.channel_scaling else -1,
                        codec.token_group if codec.axis == "token" else 0)


@functools.cache
def page_layout(fmt: KVPageFormat) -> PageLayout:
    v = None if fmt.v is None else _tensor_layout(fmt.v, fmt.k.nbytes)
    return PageLayout(_tensor_layout(fmt.k, 0), v, fmt.page_bytes,
                      fmt.block_size, fmt.k.num_heads, fmt.k.head_size)


def kernel_supports(fmt: KVPageFormat) -> str | None:
    """None if the decode kernel reads this format, else why not."""
    if fmt.recent is not None:
        return "recent 16-bit window (KVmix RPC)"
    if fmt.v is None:
        return "K-only pages (slim attention)"
    if isinstance(fmt.k, MinMaxCodec) and fmt.k.axis != "channel":
        return "K quantized per token"
    if isinstance(fmt.v, MinMaxCodec) and fmt.v.axis != "token":
        return "V quantized per channel"
    d = fmt.k.head_size
    if d & (d - 1):
        return f"head size {d} (powers of two only)"
    return None
