"""Decode rows' write into ZipCache's pages (``formats.salient``): the new token, the probe's scores
and the block's re-compression in one program per (request, KV head).

The program holds the head's last block as 4-bit codes ``[B, D/4, 4]`` (token, byte, position in
the byte). It scores the block's tokens with the decode query's attention probabilities, from the
log-sum-exp of its attention over the whole context (``salient_decode``), picks the block's
4-bit tokens (``salient_torch._recompressed``: of the still-salient tokens and the new one, the
best-scored up to the block's quota, or up to its slots while holding), appends the new token under
the 4-bit codec's append rule on K's per-channel grid (a channel the new value leaves widens and
its earlier tokens are requantized from the level they read as; ``MinMaxCodec.encode``) and V's
own per-token grid, and writes the head's planes and refinement rows back, the refinement rows
laid out in token order as the torch reference lays them. Equal to ``salient_torch.write_decoded``
on the same pages.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_kvcompress.config import SalientSpec
from vllm_kvcompress.formats.salient import NO_SLOT, SalientTokensFormat
from vllm_kvcompress.salient_torch import last_block_random_scores

from .write import _code_on, _half, _min_max_stats, _widened_span

_TOP = tl.constexpr(15.0)  # highest 4-bit code


@triton.jit
def _plane(page, REGION: tl.constexpr, row, u, shift, mask, U: tl.constexpr):
    """2-bit codes [rows, U, 4] of head rows ``row`` ([rows, 1, 1]) of a plane of U-byte rows."""
    return (tl.load(page + REGION + row * U + u, mask=mask, other=0).to(tl.int32) >> shift) & 3


@triton.jit
def _store_plane(page, REGION: tl.constexpr, row, byte, codes, shift, mask, U: tl.constexpr):
    """2-bit ``codes`` [rows, U, 4] packed into bytes ``byte`` ([1, U]) of the rows ``row`` ([rows, 1])
    of a plane."""
    packed = tl.sum((codes & 3) << shift, 2)
    tl.store(page + REGION + row * U + byte, packed.to(tl.uint8), mask=mask)


@triton.jit
def _salient_write_kernel(q_ptr, k_ptr, v_ptr, lse_ptr, scores_ptr, pages_ptr, table_ptr, lens_ptr, quota_ptr,
                          scale, interval, q_row_stride, q_head_stride, k_row_stride, v_row_stride, table_stride,
                          PAGE: tl.constexpr, B: tl.constexpr, R: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                          H: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr, V_SCALE: tl.constexpr,
                          V_ZERO: tl.constexpr, K_HIGH: tl.constexpr, V_HIGH: tl.constexpr, K_LOW: tl.constexpr,
                          V_LOW: tl.constexpr, SLOT_OF: tl.constexpr, NONE: tl.constexpr, GIVEN: tl.constexpr):
    row, h = tl.program_id(0), tl.program_id(1)
    length = tl.load(lens_ptr + row)
    o = (length - 1) % B  # the new token's place in its block
    block = tl.load(table_ptr + row * table_stride + (length - 1) // B).to(tl.int64)
    page = pages_ptr + block * PAGE
    U: tl.constexpr = D // 4
    tokens = tl.arange(0, B)
    t = tokens[:, None, None]
    u = tl.arange(0, U)[None, :, None]
    j = tl.arange(0, 4)[None, None, :]
    ch = u * 4 + j
    shift = j * 2
    earlier = t < o
    is_new = t == o
    slot = tl.load(page + SLOT_OF + h * B + tokens).to(tl.int32)
    salient = slot != NONE
    old_row = (h * R + tl.where(salient, slot, 0))[:, None, None]
    lows = earlier & salient[:, None, None]

    # K as stored: 4-bit codes (a 2-bit token's low bits 0, as the codec's page holds them) and the
    # level each token reads as; the new token exact
    k_high = _plane(page, K_HIGH, h * B + t, u, shift, earlier, U)
    k_low = _plane(page, K_LOW, old_row, u, shift, lows, U)
    k_stored = k_high * 4 + k_low
    k_zero = _half(page + K_ZERO + (h * D + ch) * 2, ch < D, 0.0)
    k_scale = _half(page + K_SCALE + (h * D + ch) * 2, ch < D, 1.0)
    level = k_high.to(tl.float32) * 4.0 + tl.where(lows, k_low.to(tl.float32), 1.5)
    k_new = tl.load(k_ptr + row * k_row_stride + h * D + ch).to(tl.float32)
    x = tl.where(is_new, k_new, tl.where(earlier, level * k_scale + k_zero, 0.0))

    # the decode query's probabilities over the block (its probe), or the scores given
    if GIVEN:
        score = tl.load(scores_ptr + (row * B + tokens) * H + h)
    else:
        score = tl.zeros([B], tl.float32)
        for g in tl.static_range(G):
            qg = tl.load(q_ptr + row * q_row_stride + (h * G + g) * q_head_stride + ch).to(tl.float32)
            logit = tl.sum(tl.sum(x * qg, 2), 1) * scale
            score += tl.exp(logit - tl.load(lse_ptr + (row * H + h) * G + g))

    # the block's 4-bit tokens: the best-scored candidates (ties to the earlier token) up to the quota
    candidate = (salient & (tokens < o)) | (tokens == o)
    quota = tl.where(length % interval != 0, R, tl.load(quota_ptr + o + 1))
    s_t, s_u = score[:, None], score[None, :]
    better = candidate[None, :] & ((s_u > s_t) | ((s_u == s_t) & (tokens[None, :] < tokens[:, None])))
    keep = candidate & (tl.sum(better.to(tl.int32), 1) < quota)
    new_slot = tl.cumsum(keep.to(tl.int32), 0) - 1

    # K: the append rule on each channel's grid (a block's first token sets its grid)
    has_old = o > 0
    q_old = _code_on(k_new, k_zero, k_scale)
    off_grid = (q_old < 0.0) | (q_old > _TOP)
    wide_zero, wide_scale = _min_max_stats(*_widened_span(k_new, k_new, k_zero, k_zero + k_scale * _TOP), _TOP)
    own_zero, own_scale = _min_max_stats(k_new, k_new, _TOP)
    kept = has_old & ~off_grid
    zero = tl.where(kept, k_zero.to(tl.float16), tl.where(has_old, wide_zero, own_zero))
    step = tl.where(kept, k_scale.to(tl.float16), tl.where(has_old, wide_scale, own_scale))
    k_codes = tl.minimum(tl.maximum(_code_on(x, zero.to(tl.float32), step.to(tl.float32)), 0.0), _TOP).to(tl.int32)
    k_codes = tl.where(kept & earlier, k_stored, tl.where(t <= o, k_codes, 0))

    # V: the new token on its own grid; earlier tokens as stored
    v_new = tl.load(v_ptr + row * v_row_stride + h * D + ch).to(tl.float32)  # [1, U, 4]
    v_zero, v_scale = _min_max_stats(tl.min(tl.min(v_new, 2), 1), tl.max(tl.max(v_new, 2), 1), _TOP)  # [1]
    v_code = tl.minimum(tl.maximum(_code_on(v_new, v_zero.to(tl.float32)[:, None, None],
                                            v_scale.to(tl.float32)[:, None, None]), 0.0), _TOP).to(tl.int32)
    v_stored = _plane(page, V_HIGH, h * B + t, u, shift, earlier, U) * 4 + _plane(page, V_LOW, old_row, u, shift,
                                                                                  lows, U)
    v_codes = tl.where(is_new, v_code, v_stored)

    tl.debug_barrier()  # every earlier byte is read before any is written
    tl.store((page + K_ZERO + (h * D + ch) * 2).to(tl.pointer_type(tl.float16)), zero, mask=ch < D)
    tl.store((page + K_SCALE + (h * D + ch) * 2).to(tl.pointer_type(tl.float16)), step, mask=ch < D)
    at_o = h * B + o + tl.zeros([1], tl.int32)
    tl.store((page + V_ZERO + at_o * 2).to(tl.pointer_type(tl.float16)), v_zero)
    tl.store((page + V_SCALE + at_o * 2).to(tl.pointer_type(tl.float16)), v_scale)
    rows = tokens[:, None]
    u2 = tl.arange(0, U)[None, :]
    _store_plane(page, K_HIGH, h * B + rows, u2, k_codes >> 2, shift, u2 < U, U)
    _store_plane(page, V_HIGH, h * B + rows, u2, v_codes >> 2, shift, (rows == o) & (u2 < U), U)
    low_row = h * R + tl.where(keep, new_slot, 0)[:, None]
    _store_plane(page, K_LOW, low_row, u2, k_codes, shift, keep[:, None] & (u2 < U), U)
    _store_plane(page, V_LOW, low_row, u2, v_codes, shift, keep[:, None] & (u2 < U), U)
    tl.store(page + SLOT_OF + h * B + tokens, tl.where(keep, new_slot, NONE).to(tl.uint8))


@functools.cache
def _quotas(fmt: SalientTokensFormat, device: torch.device) -> torch.Tensor:
    """[B + 1] int32: the 4-bit tokens a block of n tokens keeps after a re-compression."""
    return fmt.quota(torch.arange(fmt.block_size + 1)).to(device, torch.int32)


def write_decoded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                  fmt: SalientTokensFormat, spec: SalientSpec, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  lse: torch.Tensor, scale: float) -> None:
    """``salient_torch.write_decoded``'s contract: each decode row's new token (``key``/``value`` [N,
    H, D]) into its last block, scored by its ``query`` [N, Hq, D] with ``lse`` [N, Hq] (its
    attention's log-sum-exp over the whole context)."""
    n, hq, d = query.shape
    heads = fmt.k.num_heads
    if n == 0:
        return
    scores = last_block_random_scores(seq_lens, fmt.block_size, heads, spec) if spec.score == "random" else None
    at = fmt.regions.start
    _salient_write_kernel[(n, heads)](
        query, key, value, lse.contiguous(), scores, cache, block_table, seq_lens, _quotas(fmt, cache.device), scale,
        spec.recompress_interval, query.stride(0), query.stride(1), key.stride(0), value.stride(0),
        block_table.stride(0), PAGE=fmt.page_bytes, B=fmt.block_size, R=fmt.slots, D=d, G=hq // heads, H=heads,
        K_SCALE=at("k_scale"), K_ZERO=at("k_zero"), V_SCALE=at("v_scale"), V_ZERO=at("v_zero"),
        K_HIGH=at("k_high"), V_HIGH=at("v_high"), K_LOW=at("k_low"), V_LOW=at("v_low"), SLOT_OF=at("slot_of"),
        NONE=NO_SLOT, GIVEN=scores is not None, num_warps=8)
