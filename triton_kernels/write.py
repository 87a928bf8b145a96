"""Cache write: quantize, pack and store new tokens into their pages in one pass.

Divisions and square roots are IEEE-rounded (``div_rn``, ``sqrt_rn``) so the
bytes match the torch reference. One program per (token, KV head), and only the program of the last new token
of each block works: it reads the block's earlier tokens back from the page,
adds the new ones, recomputes the statistics over all of them and writes the
whole block, exactly as ``paged_torch.write_tokens`` does.

Values sit in registers as ``[BLOCK, UNITS, PER]``: token, storage unit (a byte,
or a 32-bit word for 3 bits) and position inside the unit; channel
``unit * VALS + position``. Packing is then a shifted sum over the last axis.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats import KVPageFormat

from .layout import page_layout


@triton.jit
def _write_tensor(src_ptr, src_stride, j, is_new, valid, page, h,
                  H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                  BITS: tl.constexpr, VALS: tl.constexpr, UNITS: tl.constexpr, PER: tl.constexpr,
                  CODES: tl.constexpr, ROW: tl.constexpr, SCALE: tl.constexpr, ZERO: tl.constexpr,
                  CS: tl.constexpr, PER_CHANNEL: tl.constexpr):
    t = tl.arange(0, BLOCK)[:, None, None]
    u = tl.arange(0, UNITS)[None, :, None]
    p = tl.arange(0, PER)[None, None, :]
    ch = u * VALS + p
    ch_ok = (p < VALS) & (ch < D)
    if BITS == 3:
        width = tl.where(p == 10, 2, 3)
        top = tl.where(p == 10, 3.0, 7.0)
        ratio = tl.where(p == 10, 7.0 / 3.0, 1.0)
    else:
        width = BITS
        top = (1 << BITS) - 1.0
        ratio = 1.0
    full_top: tl.constexpr = (1 << BITS) - 1.0
    row = page + CODES + (t * H + h) * ROW
    newm = is_new[:, None, None] & ch_ok
    oldm = valid[:, None, None] & (is_new[:, None, None] == 0) & ch_ok
    x_new = tl.load(src_ptr + j[:, None, None] * src_stride + h * D + ch, mask=newm, other=0.0).to(tl.float32)

    # earlier tokens of the block, decoded from the page
    if BITS == 3:
        unit = tl.load((row + u * 4).to(tl.pointer_type(tl.int32)), mask=(t < BLOCK) & (u * VALS < D), other=0)
    else:
        unit = tl.load(row + u, mask=(t < BLOCK) & (u * VALS < D), other=0).to(tl.int32)
    shift = p * BITS if BITS != 3 else p * 3
    old_codes = ((unit >> shift) & ((1 << width) - 1)).to(tl.float32)
    if PER_CHANNEL:
        sz = (h * D + ch) * 2
        scale = tl.load((page + SCALE + sz).to(tl.pointer_type(tl.float16)), mask=ch_ok, other=0.0).to(tl.float32)
        zero = tl.load((page + ZERO + sz).to(tl.pointer_type(tl.float16)), mask=ch_ok, other=0.0).to(tl.float32)
    else:
        sz = (t * H + h) * 2
        scale = tl.load((page + SCALE + sz).to(tl.pointer_type(tl.float16))).to(tl.float32)
        zero = tl.load((page + ZERO + sz).to(tl.pointer_type(tl.float16))).to(tl.float32)
    x_old = old_codes * (scale * ratio) + zero
    if CS >= 0:
        cs_old = tl.load((page + CS + (h * D + ch) * 2).to(tl.pointer_type(tl.float16)), mask=ch_ok,
                         other=1.0).to(tl.float32)
        x_old = x_old * cs_old
    x = tl.where(newm, x_new, tl.where(oldm, x_old, 0.0))
    rows_ok = valid[:, None, None] & ch_ok

    if CS >= 0:  # ZipCache: divide channels by sqrt(max |x|) over the block
        amax = tl.max(tl.where(rows_ok, tl.abs(x), 0.0), 0)[None, :, :]
        cs = tl.sqrt_rn(tl.maximum(amax, 1e-6)).to(tl.float16)
        tl.store((page + CS + (h * D + ch) * 2).to(tl.pointer_type(tl.float16)), cs, mask=ch_ok)
        x = tl.math.div_rn(x, cs.to(tl.float32) + tl.zeros_like(x))
    if PER_CHANNEL:
        mn = tl.min(tl.where(rows_ok, x, float("inf")), 0)[None, :, :]
        mx = tl.max(tl.where(rows_ok, x, float("-inf")), 0)[None, :, :]
    else:
        mn = tl.min(tl.min(tl.where(rows_ok, x, float("inf")), 2), 1)[:, None, None]
        mx = tl.max(tl.max(tl.where(rows_ok, x, float("-inf")), 2), 1)[:, None, None]
    mn = tl.where(mn == float("inf"), 0.0, mn)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    zero_h = mn.to(tl.float16)
    scale_h = tl.maximum(tl.math.div_rn(mx - zero_h.to(tl.float32), full_top + tl.zeros_like(mx)), 1e-6).to(tl.float16)
    step = scale_h.to(tl.float32) * ratio
    codes = tl.floor(tl.math.div_rn(x - zero_h.to(tl.float32), step + tl.zeros_like(x)) + 0.5)
    codes = tl.minimum(tl.maximum(codes, 0.0), top)
    codes = tl.where(rows_ok, codes, 0.0).to(tl.int64)
    packed = tl.sum(codes << shift.to(tl.int64), 2)  # [BLOCK, UNITS]
    urow = page + CODES + (tl.arange(0, BLOCK)[:, None] * H + h) * ROW
    uu = tl.arange(0, UNITS)[None, :]
    if BITS == 3:
        tl.store((urow + uu * 4).to(tl.pointer_type(tl.int32)), packed.to(tl.uint32).to(tl.int32, bitcast=True),
                 mask=uu * VALS < D)
    else:
        tl.store(urow + uu, packed.to(tl.uint8), mask=uu * VALS < D)
    if PER_CHANNEL:  # statistics [1, UNITS, PER]
        tl.store((page + SCALE + sz).to(tl.pointer_type(tl.float16)), scale_h, mask=ch_ok)
        tl.store((page + ZERO + sz).to(tl.pointer_type(tl.float16)), zero_h, mask=ch_ok)
    else:  # statistics [BLOCK, 1, 1]
        tl.store((page + SCALE + sz).to(tl.pointer_type(tl.float16)), scale_h)
        tl.store((page + ZERO + sz).to(tl.pointer_type(tl.float16)), zero_h)


@triton.jit
def _write_raw(src_ptr, src_stride, j, is_new, page, h, H: tl.constexpr, D: tl.constexpr,
               BLOCK: tl.constexpr, OFF: tl.constexpr, ROW: tl.constexpr):
    t = tl.arange(0, BLOCK)[:, None]
    d = tl.arange(0, D)[None, :]
    x = tl.load(src_ptr + j[:, None] * src_stride + h * D + d, mask=is_new[:, None], other=0.0)
    dst = (page + OFF + (t * H + h) * ROW).to(tl.pointer_type(src_ptr.dtype.element_ty)) + d
    tl.store(dst, x, mask=is_new[:, None])


@triton.jit
def _write_kernel(key_ptr, value_ptr, slot_ptr, cache_ptr, num_tokens, page_bytes, k_stride, v_stride,
                  H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                  K_BITS: tl.constexpr, K_VALS: tl.constexpr, K_UNITS: tl.constexpr, K_PER: tl.constexpr,
                  K_CODES: tl.constexpr, K_ROW: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
                  V_BITS: tl.constexpr, V_VALS: tl.constexpr, V_UNITS: tl.constexpr, V_PER: tl.constexpr,
                  V_CODES: tl.constexpr, V_ROW: tl.constexpr, V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
                  V_CS: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    nxt = tl.load(slot_ptr + i + 1, mask=i + 1 < num_tokens, other=-1).to(tl.int64)
    blk = slot // BLOCK
    off = slot % BLOCK
    if (slot >= 0) & ((nxt < 0) | (nxt // BLOCK != blk)):
        t = tl.arange(0, BLOCK)
        j = i - (off - t)
        in_batch = (j >= 0) & (t <= off)
        is_new = in_batch & (tl.load(slot_ptr + j, mask=in_batch, other=-1).to(tl.int64) == blk * BLOCK + t)
        valid = t <= off
        page = cache_ptr + blk * page_bytes
        if K_BITS == 16:
            _write_raw(key_ptr, k_stride, j, is_new, page, h, H, D, BLOCK, K_CODES, K_ROW)
        else:
            _write_tensor(key_ptr, k_stride, j, is_new, valid, page, h, H, D, BLOCK, K_BITS, K_VALS, K_UNITS,
                          K_PER, K_CODES, K_ROW, K_SCALE, K_ZERO, -1, True)
        if V_BITS == 16:
            _write_raw(value_ptr, v_stride, j, is_new, page, h, H, D, BLOCK, V_CODES, V_ROW)
        else:
            _write_tensor(value_ptr, v_stride, j, is_new, valid, page, h, H, D, BLOCK, V_BITS, V_VALS, V_UNITS,
                          V_PER, V_CODES, V_ROW, V_SCALE, V_ZERO, V_CS, False)


def _geometry(bits: int, d: int) -> tuple[int, int, int]:
    """(values per unit, units per row padded to a power of two, values per unit padded)."""
    if bits == 16:
        return 1, 1, 1
    vals = 11 if bits == 3 else 8 // bits
    return vals, triton.next_power_of_2(-(-d // vals)), triton.next_power_of_2(vals)


def write_tokens(cache: torch.Tensor, fmt: KVPageFormat, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Same contract as ``paged_torch.write_tokens``; key/value [N, H, D] (row-strided views allowed)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    lay = page_layout(fmt)
    kv, ku, kp = _geometry(lay.k.bits, lay.head_size)
    vv, vu, vp = _geometry(lay.v.bits, lay.head_size)
    _write_kernel[(n, lay.num_kv_heads)](
        key, value, slot_mapping, cache, n, lay.page_bytes, key.stride(0), value.stride(0),
        H=lay.num_kv_heads, D=lay.head_size, BLOCK=lay.block_size,
        K_BITS=lay.k.bits, K_VALS=kv, K_UNITS=ku, K_PER=kp, K_CODES=lay.k.codes, K_ROW=lay.k.row_bytes,
        K_SCALE=lay.k.scale, K_ZERO=lay.k.zero,
        V_BITS=lay.v.bits, V_VALS=vv, V_UNITS=vu, V_PER=vp, V_CODES=lay.v.codes, V_ROW=lay.v.row_bytes,
        V_SCALE=lay.v.scale, V_ZERO=lay.v.zero, V_CS=lay.v.channel_scale,
    )
