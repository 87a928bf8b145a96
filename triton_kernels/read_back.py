"""Read back, in the model's dtype, the K and V that pages store for a step's new tokens.

A prompt chunk with no history attends only to its own tokens, which the step has just written:
their values as stored, read back here, go to FlashAttention's prefill (``prompt_attention``),
which attends to exactly what the pages hold. Only the step's own tokens are read back, into
buffers the size of the step's K and V, never the cache's history.

Values are those of ``MinMaxCodec.decode``: ``code * step + zero``, where step is the scale (7/3
of it for the 2-bit slot of a 3-bit word), times the ZipCache channel scale where there is one.
One program reads ``TOKENS`` tokens of one KV head, each from its own slot.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats import KVPageFormat

from .addressing import code_grid, code_unit_ptr, load_units, unpack_codes
from .launch import Variant, launch
from .layout import TensorLayout, page_layout

TOKENS = 16  # a program's tokens


@triton.jit
def _read_codes(page, CODES: tl.constexpr, off, h, d, ROW: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                GROUP: tl.constexpr, mask):
    """Codes [T, D] (float32) of tokens at offsets ``off`` [T, 1] of pages ``page`` [T, 1], and each
    channel's step over the scale (``code_grid``: 7/3 for the 2-bit slot of a 3-bit word, else 1)."""
    VALS: tl.constexpr = 11 if BITS == 3 else 8 // BITS  # codes a storage unit
    width, _, ratio, shift = code_grid(d % VALS, BITS)
    units = load_units(code_unit_ptr(page, CODES, off, h, d // VALS, ROW, BLOCK, BITS, GROUP), mask, BITS)
    return unpack_codes(units, width, shift), ratio


@triton.jit
def _read_tensor(page, half, off, h, d, mask, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                 BITS: tl.constexpr, CODES: tl.constexpr, ROW: tl.constexpr, SCALE: tl.constexpr,
                 ZERO: tl.constexpr, CS: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr,
                 dtype: tl.constexpr):
    """One tensor's (K's or V's) values [T, D] for tokens at ``off`` of ``page`` (``half``: the
    same pages as float16), as float32."""
    if BITS == 16:  # raw rows, token-major
        return tl.load((page + CODES + (off * H + h) * ROW).to(tl.pointer_type(dtype)) + d, mask=mask,
                       other=0.0).to(tl.float32)
    codes, ratio = _read_codes(page, CODES, off, h, d, ROW, BLOCK, BITS, GROUP, mask)
    if PER_CHANNEL:
        stat = h * D + d
    else:
        stat = h * BLOCK + off
    scale = tl.load(half + SCALE // 2 + stat, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(half + ZERO // 2 + stat, mask=mask, other=0.0).to(tl.float32)
    x = codes * (scale * ratio) + zero
    if CS >= 0:
        x = x * tl.load(half + CS // 2 + h * D + d, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit(do_not_specialize=["num_tokens"])
def _read_back_kernel(
    slots_ptr, cache_ptr, half_ptr, k_ptr, v_ptr, num_tokens, page_bytes,
    H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr,
    K_BITS: tl.constexpr, K_CODES: tl.constexpr, K_ROW: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
    V_BITS: tl.constexpr, V_CODES: tl.constexpr, V_ROW: tl.constexpr, V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
    V_CS: tl.constexpr, V_GROUP: tl.constexpr,
):
    h = tl.program_id(1)
    i = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)[:, None]
    slot = tl.load(slots_ptr + i, mask=i < num_tokens, other=-1).to(tl.int64)
    mask = slot >= 0
    block, off = slot // BLOCK, slot % BLOCK
    page = cache_ptr + block * page_bytes
    half = half_ptr + block * (page_bytes // 2)
    d = tl.arange(0, D)[None, :]
    dtype = k_ptr.dtype.element_ty
    dst = (i * H + h) * D + d
    k = _read_tensor(page, half, off, h, d, mask, H, D, BLOCK, K_BITS, K_CODES, K_ROW, K_SCALE, K_ZERO, -1, 0,
                     True, dtype)
    stored = i < num_tokens
    tl.store(k_ptr + dst, k.to(dtype), mask=stored)
    v = _read_tensor(page, half, off, h, d, mask, H, D, BLOCK, V_BITS, V_CODES, V_ROW, V_SCALE, V_ZERO, V_CS,
                     V_GROUP, False, dtype)
    tl.store(v_ptr + dst, v.to(dtype), mask=stored)


def _constants(name: str, t: TensorLayout) -> dict:
    return {f"{name}_BITS": t.bits, f"{name}_CODES": t.codes, f"{name}_ROW": t.row_bytes,
            f"{name}_SCALE": t.scale, f"{name}_ZERO": t.zero}


@functools.cache
def _variant(fmt: KVPageFormat) -> Variant:
    lay = page_layout(fmt)
    return Variant(_read_back_kernel,
                   dict(H=lay.num_kv_heads, D=lay.head_size, BLOCK=lay.block_size, TOKENS=TOKENS,
                        **_constants("K", lay.k), **_constants("V", lay.v), V_CS=lay.v.channel_scale,
                        V_GROUP=lay.v.token_group),
                   {"num_warps": 4})


def stored_kv(cache: torch.Tensor, fmt: KVPageFormat, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[N, H, D]`` in the format's dtype as the pages ``cache`` ([num_blocks, page_bytes]
    uint8) store them at ``slots`` ([N]), for formats the decode kernel reads
    (``layout.kernel_supports``). A negative slot (vLLM's padding, as in CUDA-graph capture and
    warm-up runs) reads as zeros, and no page is read for it."""
    n, h, d = slots.shape[0], fmt.k.num_heads, fmt.k.head_size
    k = torch.empty(n, h, d, dtype=fmt.dtype, device=cache.device)
    v = torch.empty_like(k)
    if n:
        launch(_variant(fmt), (triton.cdiv(n, TOKENS), h),
               (slots, cache, cache.view(torch.float16), k, v, n, fmt.page_bytes))
    return k, v
