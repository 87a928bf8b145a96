"""Decode attention straight from ZipCache's pages (``formats.salient``): 2-bit codes for every
token, the low 2 bits of the salient ones gathered through the block's slot map, on one 4-bit grid.

One program per (request, KV head) reads its request's pages once for all the query heads of that
KV head (or per group of a prompt chunk's tokens, which all read the same history: ``token_rows``): per tile of tokens, the high plane, the slot map and, for salient tokens only, their
refinement rows; a token's code is ``4 hi + lo`` (salient) or ``4 hi + 1.5``, dequantized with K's
per-channel and V's per-token statistics in registers. Besides the output it writes each row's
log-sum-exp per query head (base e), from which the write takes the probabilities the decode query
gave the request's last block (its probe) without a second pass over the context.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats.salient import NO_SLOT, SalientTokensFormat
from vllm_kvcompress.token_rows import TokenGroups

from .decode import _LOG2E
from .history_rows import history_outputs, online_softmax_step, program_rows, store_rows


@triton.jit
def plane(page, REGION: tl.constexpr, row, u, shift, mask, U: tl.constexpr):
    """2-bit codes [rows, U, 4] (int32) of rows ``row`` ([rows, 1, 1]) of a plane of U-byte rows:
    each byte loaded once, its four codes shifted out (``shift``: [1, 1, 4])."""
    return (tl.load(page + REGION + row * U + u, mask=mask, other=0).to(tl.int32) >> shift) & 3


@triton.jit
def _codes(page, HIGH: tl.constexpr, LOW: tl.constexpr, SLOT_OF: tl.constexpr, h, t, valid, u, shift,
           B: tl.constexpr, R: tl.constexpr, U: tl.constexpr, NONE: tl.constexpr):
    """4-bit codes [T, U, 4] as float32 (channel ``4 u + position``) of tokens ``t`` (offsets in the
    block) of head ``h``."""
    slot = tl.load(page + SLOT_OF + h * B + t, mask=valid, other=NONE).to(tl.int32)
    salient = (slot != NONE)[:, None, None]
    valid = valid[:, None, None]
    high = plane(page, HIGH, (h * B + t)[:, None, None], u, shift, valid, U).to(tl.float32)
    low = plane(page, LOW, (h * R + slot)[:, None, None], u, shift, valid & salient, U).to(tl.float32)
    return high * 4.0 + tl.where(salient, low, 1.5)


@triton.jit
def _tile(page, h, t, valid, u, ch, shift, B: tl.constexpr, R: tl.constexpr, D: tl.constexpr, U: tl.constexpr,
          K_SCALE: tl.constexpr, K_ZERO: tl.constexpr, V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
          K_HIGH: tl.constexpr, V_HIGH: tl.constexpr, K_LOW: tl.constexpr, V_LOW: tl.constexpr,
          SLOT_OF: tl.constexpr, NONE: tl.constexpr):
    """K and V [T, U, 4] (float32) of tokens ``t`` of head ``h``: K on its per-channel grids, V on
    its per-token ones."""
    k_scale = tl.load((page + K_SCALE).to(tl.pointer_type(tl.float16)) + h * D + ch).to(tl.float32)
    k_zero = tl.load((page + K_ZERO).to(tl.pointer_type(tl.float16)) + h * D + ch).to(tl.float32)
    k = _codes(page, K_HIGH, K_LOW, SLOT_OF, h, t, valid, u, shift, B, R, U, NONE) * k_scale + k_zero
    v_scale = tl.load((page + V_SCALE).to(tl.pointer_type(tl.float16)) + h * B + t, mask=valid, other=0.0)
    v_zero = tl.load((page + V_ZERO).to(tl.pointer_type(tl.float16)) + h * B + t, mask=valid, other=0.0)
    v = (_codes(page, V_HIGH, V_LOW, SLOT_OF, h, t, valid, u, shift, B, R, U, NONE)
         * v_scale.to(tl.float32)[:, None, None] + v_zero.to(tl.float32)[:, None, None])
    return k, v


@triton.jit
def _salient_decode_kernel(q_ptr, pages_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr, group_rows_ptr, group_starts_ptr,
                           scale, q_row_stride, q_head_stride, table_stride, out_row_stride, out_head_stride,
                           lse_row_stride, PAGE: tl.constexpr, B: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
                           G: tl.constexpr, MP: tl.constexpr, GROUPED: tl.constexpr, TILE: tl.constexpr,
                           K_SCALE: tl.constexpr, K_ZERO: tl.constexpr, V_SCALE: tl.constexpr,
                           V_ZERO: tl.constexpr, K_HIGH: tl.constexpr, V_HIGH: tl.constexpr,
                           K_LOW: tl.constexpr, V_LOW: tl.constexpr, SLOT_OF: tl.constexpr, NONE: tl.constexpr):
    row, length, token, head, live, q = program_rows(q_ptr, lens_ptr, group_rows_ptr, group_starts_ptr, scale,
                                                     q_row_stride, q_head_stride, G, MP, D, GROUPED)
    h = tl.program_id(1)
    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.zeros([MP], tl.float32)
    acc = tl.zeros([MP, D], tl.float32)
    U: tl.constexpr = D // 4
    u = tl.arange(0, U)[None, :, None]
    j = tl.arange(0, 4)[None, None, :]
    for start in range(0, length, TILE):
        block = tl.load(table_ptr + row * table_stride + start // B).to(tl.int64)
        page = pages_ptr + block * PAGE
        t = start % B + tl.arange(0, TILE)
        valid = start + tl.arange(0, TILE) < length
        k, v = _tile(page, h, t, valid, u, u * 4 + j, j * 2, B, R, D, U, K_SCALE, K_ZERO, V_SCALE, V_ZERO, K_HIGH,
                     V_HIGH, K_LOW, V_LOW, SLOT_OF, NONE)
        m_i, l_i, acc = online_softmax_step(q, tl.reshape(k, [TILE, D]), tl.reshape(v, [TILE, D]), valid, m_i, l_i,
                                            acc)
    store_rows(out_ptr, lse_ptr, acc, m_i, l_i, token, head, live, out_row_stride, out_head_stride, lse_row_stride, D)


@triton.jit
def _salient_decode_one_row_kernel(q_ptr, pages_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr, scale, q_row_stride,
                                   q_head_stride, table_stride, out_row_stride, out_head_stride, lse_row_stride,
                                   PAGE: tl.constexpr, B: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
                                   TILE: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
                                   V_SCALE: tl.constexpr, V_ZERO: tl.constexpr, K_HIGH: tl.constexpr,
                                   V_HIGH: tl.constexpr, K_LOW: tl.constexpr, V_LOW: tl.constexpr,
                                   SLOT_OF: tl.constexpr, NONE: tl.constexpr):
    """One query head a KV head and one token a program (MHA decode rows): products and sums in
    registers, with no matrix unit (whose 16 rows would hold one)."""
    row, h = tl.program_id(0), tl.program_id(1)
    length = tl.load(lens_ptr + row)
    U: tl.constexpr = D // 4
    u = tl.arange(0, U)[None, :, None]
    j = tl.arange(0, 4)[None, None, :]
    ch = u * 4 + j
    shift = j * 2
    q = tl.load(q_ptr + row * q_row_stride + h * q_head_stride + ch).to(tl.float32) * (scale * _LOG2E)  # [1, U, 4]
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, U, 4], tl.float32)
    for start in range(0, length, TILE):
        block = tl.load(table_ptr + row * table_stride + start // B).to(tl.int64)
        page = pages_ptr + block * PAGE
        t = start % B + tl.arange(0, TILE)
        valid = start + tl.arange(0, TILE) < length
        k, v = _tile(page, h, t, valid, u, ch, shift, B, R, D, U, K_SCALE, K_ZERO, V_SCALE, V_ZERO, K_HIGH, V_HIGH,
                     K_LOW, V_LOW, SLOT_OF, NONE)
        s = tl.where(valid, tl.sum(tl.sum(k * q, 2), 1), float("-inf"))  # [TILE], base 2
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[:, None, None] + tl.sum(p[:, None, None] * v, 0)[None, :, :]
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None, None]
    tl.store(out_ptr + row * out_row_stride + h * out_head_stride + ch, out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + row * lse_row_stride + h + tl.arange(0, 1), (m_i + tl.log2(l_i)) / _LOG2E)


def salient_decode(q: torch.Tensor, pages: torch.Tensor, fmt: SalientTokensFormat, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                   groups: TokenGroups | None = None):
    """Query rows ``q`` [N, Hq, D], each over its ``seq_lens`` tokens in ``pages`` [num_blocks,
    page_bytes] by its row of ``block_table``; with ``groups`` (``token_rows``), the rows of a group
    share them and one program takes the group. Returns the output [N, Hq, D] and each row's
    log-sum-exp [N, Hq] (a row of no tokens: 0 and -inf)."""
    n, hq, _ = q.shape
    heads = fmt.k.num_heads
    group = hq // heads
    out, lse = history_outputs(q, out)
    if n == 0:
        return out, lse
    strides = (q.stride(0), q.stride(1), block_table.stride(0), out.stride(0), out.stride(1), lse.stride(0))
    if group == 1 and groups is None:
        _salient_decode_one_row_kernel[(n, heads)](q, pages, block_table, seq_lens, out, lse, scale, *strides,
                                                   num_warps=4, **page_constants(fmt))
        return out, lse
    size = 1 if groups is None else groups.size
    _salient_decode_kernel[(n if groups is None else groups.starts.shape[0], heads)](
        q, pages, block_table, seq_lens, out, lse, None if groups is None else groups.rows,
        None if groups is None else groups.starts, scale, *strides, num_warps=4,
        G=group, MP=max(16, triton.next_power_of_2(size * group)), GROUPED=groups is not None, **page_constants(fmt))
    return out, lse


@functools.cache  # read at every launch
def page_constants(fmt: SalientTokensFormat) -> dict:
    """The decode kernels' compile-time constants for ``fmt``'s pages (the grouped kernel adds its rows')."""
    at = fmt.regions.start
    return dict(PAGE=fmt.page_bytes, B=fmt.block_size, R=fmt.slots, D=fmt.k.head_size, TILE=min(64, fmt.block_size),
                K_SCALE=at("k_scale"), K_ZERO=at("k_zero"), V_SCALE=at("v_scale"), V_ZERO=at("v_zero"),
                K_HIGH=at("k_high"), V_HIGH=at("v_high"), K_LOW=at("k_low"), V_LOW=at("v_low"),
                SLOT_OF=at("slot_of"), NONE=NO_SLOT)
