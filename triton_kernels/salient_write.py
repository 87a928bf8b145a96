"""Writes into ZipCache's pages (``formats.salient``): new tokens, the block's choice of 4-bit tokens
and its re-compression, one program per (block, KV head), the block's tokens a tile at a time.

A program appends a block's new tokens (a decode row's one, or a prompt chunk's share of the block)
and picks the block's 4-bit tokens as ``salient_torch._recompressed`` does: of the still-salient
tokens and the new ones, the best-scored up to the block's quota (ties to the earlier token).
Scores are drawn (``random``) or computed here from the probes' attention probabilities over the
block, with the log-sum-exp of each probe's attention over its whole context (a sliding-window
layer's probe: over its window, and it scores the tokens in it alone): a prompt chunk's probes as
``salient_torch.plan_chunk_writes`` lists them, a decode row's query
(``salient_decode.decode_rows`` gives its log-sum-exp). K follows the 4-bit codec's append rule on its
per-channel grid (``MinMaxCodec.encode``: a channel that all new values fit keeps grid and codes;
any other widens, and its earlier tokens are requantized from the level they read as); V's new
tokens take their own per-token grids and earlier tokens keep theirs. Equal to the torch reference.

A token keeps its refinement row while it keeps 4 bits, and a new one takes the lowest free row, so
that a write touches only the new tokens' rows and, where the tokens' choice drops some, their
slots; only a K channel that widens re-codes the block's earlier tokens, in place and in the bytes
that hold a widened channel alone (as the 4-bit write, ``write._widen_units``). Rows are in no
particular order: the torch reference lays them out in token order, and the two are compared by
the values the pages read as.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vllm_kvcompress.config import SalientSpec
from vllm_kvcompress.formats.salient import NO_SLOT, SalientTokensFormat
from vllm_kvcompress.salient_torch import NO_WINDOW, ChunkWrites, last_block_random_scores, quota_table

from .grid import code_on, min_max_stats
from .launch import Compiled, Variant, launch, plannable, stream_handle
from .write import _half, _widened_span, ranked

_TOP = tl.constexpr(15.0)  # highest 4-bit code
TILE = 16  # a prompt chunk's tokens a program holds at once (H200: 16 with 4 warps the fastest)
# the same into fresh blocks (FRESH), H200, 32 fresh prompts of 256 tokens, MHA / GQA, us: tile 32 and
# 4 warps 512 / 150, 16 and 4 619 / 215, 8 and 4 531 / 190, 16 and 8 613 / 352 (docs/log/2026-11-30.md)
FRESH_TILE = 32
PROBES = 16  # probes a product takes at once (the matrix unit's least rows)
# a widened K channel's earlier tokens are re-coded in the bytes that hold one, these many bytes and
# tokens at a time
WIDEN_BYTES = tl.constexpr(4)
WIDEN_ROWS = tl.constexpr(32)


class DecodeTuning(NamedTuple):
    """A decode row's program: tokens a tile, warps, and the registers it may hold."""
    tile: int
    warps: int
    registers: int


# By query heads a KV head (MHA 1, else GQA), H200, 144 rows, held / widening / slots full, us.
# Registers: left to itself the compiler takes 221 (sm_90), two programs a SM, and the write waits on
# its loads (MHA 137 / 195 / 301 as compiled, 85 / 125 / 160 at 96; GQA 84 / 99 / 145, 75 / 88 / 121
# at 168). Tiles and warps: MHA 74.4 / 128.7 / 129.1 at tile 4 and 2 warps, 85.1 / 122.9 / 159.5 at
# 8 and 4; GQA 74.0 / 82.9 / 121.7 at 8 and 4, 86.6 / 95.1 / 92.5 at 4 and 2 (docs/log/2026-11-29.md)
MHA_DECODE = DecodeTuning(tile=4, warps=2, registers=96)
GQA_DECODE = DecodeTuning(tile=8, warps=4, registers=168)


def decode_tuning(group: int) -> DecodeTuning:
    """A decode row's program for ``group`` query heads a KV head."""
    return MHA_DECODE if group == 1 else GQA_DECODE


def default_tuning(group: int, decode: bool, fresh: bool) -> tuple[int, int]:
    """The write's tile and warps for ``group`` query heads a KV head, for decode rows or prompt chunks
    (into ``fresh`` blocks or not)."""
    if not decode:
        return (FRESH_TILE if fresh else TILE), 4
    tuning = decode_tuning(group)
    return tuning.tile, tuning.warps


@triton.jit
def plane(page, REGION: tl.constexpr, row, u, shift, mask, U: tl.constexpr):
    """2-bit codes [rows, U, 4] (int32) of rows ``row`` ([rows, 1, 1]) of a plane of U-byte rows:
    each byte loaded once, its four codes shifted out (``shift``: [1, 1, 4])."""
    return (tl.load(page + REGION + row * U + u, mask=mask, other=0).to(tl.int32) >> shift) & 3


@triton.jit
def _stored_k(page, h, t, byte, old_slot, mask, shift, K_HIGH: tl.constexpr, K_LOW: tl.constexpr, B: tl.constexpr,
              R: tl.constexpr, U: tl.constexpr, NONE: tl.constexpr):
    """Stored tokens ``t`` ([T, 1, 1]) of head ``h``, slots ``old_slot`` [T], in bytes ``byte`` ([1, N,
    1]) of K's planes, where ``mask``: their high and low codes [T, N, 4] (a 2-bit token's low 0),
    and the level each reads as on its 4-bit grid (a 2-bit token's low bits at 1.5)."""
    refined = (old_slot != NONE)[:, None, None]
    k_high = plane(page, K_HIGH, h * B + t, byte, shift, mask, U)
    k_low = plane(page, K_LOW, h * R + tl.where(refined, old_slot[:, None, None], 0), byte, shift, mask & refined, U)
    return k_high, k_low, k_high.to(tl.float32) * 4.0 + tl.where(refined, k_low.to(tl.float32), 1.5)


@triton.jit
def _k_tile(page, k_ptr, k_row_stride, first, h, tt, old_slot, num_stored, filled, u, ch, shift, k_scale, k_zero,
            K_HIGH: tl.constexpr, K_LOW: tl.constexpr, B: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
            U: tl.constexpr, NONE: tl.constexpr):
    """K of block tokens ``tt`` ([T]) of head ``h``, [T, U, 4]: the value every token reads as (the
    earlier ones from their stored planes, new ones exact, from ``k_ptr`` row ``first`` on)."""
    t = tt[:, None, None]
    earlier = t < num_stored
    new = (t >= num_stored) & (t < filled)
    _, _, level = _stored_k(page, h, t, u, old_slot, earlier, shift, K_HIGH, K_LOW, B, R, U, NONE)
    x_new = tl.load(k_ptr + (first + t - num_stored) * k_row_stride + h * D + ch, mask=new, other=0.0)
    return tl.where(new, x_new.to(tl.float32), tl.where(earlier, level * k_scale + k_zero, 0.0))


@triton.jit
def _bytes_of(x, pick):
    """A per-channel [1, U, 4] ``x`` at the bytes ``pick`` [N, U] takes (one each): [1, N, 4]."""
    return tl.sum(tl.where(pick[:, :, None], x, 0.0), 1)[None, :, :]


@triton.jit
def _store_plane(page, REGION: tl.constexpr, row, byte, codes, shift, mask, U: tl.constexpr):
    """2-bit ``codes`` [rows, U, 4] packed into bytes ``byte`` ([1, U]) of rows ``row`` ([rows, 1])."""
    packed = tl.sum((codes & 3) << shift, 2)
    tl.store(page + REGION + row * U + byte, packed.to(tl.uint8), mask=mask)


# values that change from step to step are not specialized on (each specialization would be compiled
# in the middle of serving)
@triton.jit(do_not_specialize=["first_block", "interval", "window", "table_stride", "lse_row_stride",
                               "lse_head_stride"])
def _salient_write_kernel(q_ptr, k_ptr, v_ptr, lse_ptr, scores_ptr, pages_ptr, blocks_ptr, stored_ptr, filled_ptr,
                          first_ptr, quota_ptr, start_ptr, probe_first_ptr, probe_end_ptr, probe_rows_ptr,
                          probe_pos_ptr, table_ptr, lens_ptr, quotas_ptr, first_block, scale, interval, window,
                          q_row_stride, q_head_stride, k_row_stride, v_row_stride, table_stride, lse_row_stride,
                          lse_head_stride,
                          PAGE: tl.constexpr,
                          B: tl.constexpr, R: tl.constexpr, D: tl.constexpr, G: tl.constexpr, H: tl.constexpr,
                          K_SCALE: tl.constexpr, K_ZERO: tl.constexpr, V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
                          K_HIGH: tl.constexpr, V_HIGH: tl.constexpr, K_LOW: tl.constexpr, V_LOW: tl.constexpr,
                          SLOT_OF: tl.constexpr, NONE: tl.constexpr, DECODE: tl.constexpr, GIVEN: tl.constexpr,
                          NORMALIZED: tl.constexpr, FRESH: tl.constexpr, TT: tl.constexpr, PP: tl.constexpr):
    # FRESH: prompt chunks' blocks that hold no earlier token (``ChunkWrites.fresh`` of them come
    # first): no stored codes to read, no grid to widen, slots in token order
    i, h = tl.program_id(0) + first_block, tl.program_id(1)
    NT: tl.constexpr = 1 if DECODE else TT  # new tokens coded at once: a decode row's one alone
    if DECODE:  # decode row i: one new token at the end of its context, its query its probe
        length = tl.load(lens_ptr + i)
        if length == 0:  # a full CUDA graph's padding row
            return
        num_stored = (length - 1) % B
        filled = num_stored + 1
        first = i
        block = tl.load(table_ptr + i * table_stride + (length - 1) // B).to(tl.int64)
        quota = tl.where(length % interval != 0, R, tl.load(quotas_ptr + filled))
        start = length - 1 - num_stored
    else:  # touched block i of prompt chunks: tokens num_stored..filled-1 new, from key row first on
        block = tl.load(blocks_ptr + i).to(tl.int64)
        num_stored = 0 if FRESH else tl.load(stored_ptr + i)
        filled = tl.load(filled_ptr + i)
        first = tl.load(first_ptr + i)
        quota = tl.load(quota_ptr + i)
        start = tl.load(start_ptr + i)
        probe_first = tl.load(probe_first_ptr + i)
        probe_end = tl.load(probe_end_ptr + i)
    page = pages_ptr + block * PAGE
    U: tl.constexpr = D // 4
    tokens = tl.arange(0, B)
    u = tl.arange(0, U)[None, :, None]
    u2 = tl.arange(0, U)[None, :]
    d = tl.arange(0, D)
    j = tl.arange(0, 4)[None, None, :]
    ch = u * 4 + j
    shift = j * 2
    if FRESH:  # no slot map to read: nothing stored
        earlier_salient = tokens < 0
        candidate = tokens < filled
    else:
        slot = tl.load(page + SLOT_OF + h * B + tokens).to(tl.int32)
        earlier_salient = (slot != NONE) & (tokens < num_stored)
        candidate = earlier_salient | ((tokens >= num_stored) & (tokens < filled))
        k_zero = _half(page + K_ZERO + (h * D + ch) * 2, ch < D, 0.0)  # [1, U, 4]
        k_scale = _half(page + K_SCALE + (h * D + ch) * 2, ch < D, 1.0)

    # K's grid per channel: the new values' span, kept, widened past the stored grid, or their own
    lo = tl.full([1, U, 4], float("inf"), tl.float32)
    hi = tl.full([1, U, 4], float("-inf"), tl.float32)
    for t0 in range(num_stored // TT * TT, filled, TT):
        t = t0 + tl.arange(0, TT)[:, None, None]
        new = (t >= num_stored) & (t < filled)
        x = tl.load(k_ptr + (first + t - num_stored) * k_row_stride + h * D + ch, mask=new, other=0.0).to(tl.float32)
        lo = tl.minimum(lo, tl.min(tl.where(new, x, float("inf")), 0)[None, :, :])
        hi = tl.maximum(hi, tl.max(tl.where(new, x, float("-inf")), 0)[None, :, :])
    own_zero, own_scale = min_max_stats(lo, hi, _TOP)
    if FRESH:
        zero, step = own_zero, own_scale
    else:
        has_old = num_stored > 0
        kept = has_old & (code_on(lo, k_zero, k_scale) >= 0.0) & (code_on(hi, k_zero, k_scale) <= _TOP)
        wide_zero, wide_scale = min_max_stats(*_widened_span(lo, hi, k_zero, k_zero + k_scale * _TOP), _TOP)
        zero = tl.where(kept, k_zero.to(tl.float16), tl.where(has_old, wide_zero, own_zero))
        step = tl.where(kept, k_scale.to(tl.float16), tl.where(has_old, wide_scale, own_scale))

    # Where the quota takes every candidate (a decoded token held while its block has a free slot,
    # the common decode step) no score is needed; where no channel widened, earlier tokens keep their
    # codes and slots: only the new tokens' tiles are written.
    num_candidates = tl.sum(candidate.to(tl.int32), 0)
    all_kept = quota >= num_candidates
    if not FRESH:
        widened = has_old & (tl.min(tl.min(tl.min(kept.to(tl.int32), 2), 1), 0) == 0)

    # the scores: the probes' probabilities over the block's tokens (with each probe's log-sum-exp over
    # its whole context), summed over the query heads of head h; NORMALIZED, divided by the number of
    # probes that see the token. A decode row's probe is its query, which sees the whole block.
    keep = candidate
    if not all_kept:
        if not GIVEN:
            for t0 in range(0, filled, TT):
                tt = t0 + tl.arange(0, TT)
                if not FRESH:
                    old_slot = tl.load(page + SLOT_OF + h * B + tt).to(tl.int32)
                    x = _k_tile(page, k_ptr, k_row_stride, first, h, tt, old_slot, num_stored, filled, u, ch, shift,
                                k_scale, k_zero, K_HIGH, K_LOW, B, R, D, U, NONE)
                if DECODE:  # one probe, the row's query: products over channels, no matrix unit
                    sees = ((start + tt) > length - 1 - window) & (tt < filled)
                    score = tl.zeros([TT], tl.float32)
                    for g in tl.static_range(G):
                        qg = tl.load(q_ptr + i * q_row_stride + (h * G + g) * q_head_stride + ch).to(tl.float32)
                        logit = tl.sum(tl.sum(x * qg, 2), 1) * scale
                        lse = tl.load(lse_ptr + i * lse_row_stride + (h * G + g) * lse_head_stride)
                        score += tl.where(sees, tl.exp(logit - lse), 0.0)
                else:
                    if FRESH:  # the new keys as they came: products of the matrix unit in its input type
                        keys = tl.load(k_ptr + (first + tt[:, None]) * k_row_stride + h * D + d[None, :],
                                       mask=(tt < filled)[:, None], other=0.0)
                    else:
                        keys = tl.reshape(x, [TT, D])
                    score = tl.zeros([TT], tl.float32)
                    seen_by = tl.zeros([TT], tl.float32)
                    for p0 in range(probe_first, probe_end, PP):  # PP probes at once, as rows of one product
                        probe = p0 + tl.arange(0, PP)
                        live = probe < probe_end
                        row = tl.load(probe_rows_ptr + probe, mask=live, other=0)
                        seen_to = tl.load(probe_pos_ptr + probe, mask=live, other=-1)
                        # [PP, TT]: a probe sees the tokens up to its own, within its window (NO_WINDOW: all)
                        sees = (((start + tt)[None, :] <= seen_to[:, None])
                                & ((start + tt)[None, :] > seen_to[:, None] - window))
                        for g in tl.static_range(G):
                            qg = tl.load(q_ptr + row[:, None] * q_row_stride + (h * G + g) * q_head_stride
                                         + d[None, :], mask=live[:, None], other=0.0).to(keys.dtype)
                            logit = tl.dot(qg, tl.trans(keys), input_precision="ieee") * scale
                            lse = tl.load(lse_ptr + row * lse_row_stride + (h * G + g) * lse_head_stride,
                                          mask=live, other=0.0)
                            score += tl.sum(tl.where(sees, tl.exp(logit - lse[:, None]), 0.0), 0)
                        seen_by += tl.sum(sees.to(tl.float32), 0)
                    if NORMALIZED:
                        score = score / tl.maximum(seen_by, 1.0)
                tl.store(scores_ptr + (i * B + tt) * H + h, score)
            tl.debug_barrier()
        if quota == num_candidates - 1:  # one to drop (a decoded token, the block's slots full): the least
            scores = tl.load(scores_ptr + (i * B + tokens) * H + h)
            least = tl.min(tl.where(candidate, scores, float("inf")), 0)
            dropped = tl.max(tl.where(candidate & (scores == least), tokens, -1), 0)  # ties: the later token
            keep = candidate & (tokens != dropped)
        else:
            keep = candidate & (_ranks(scores_ptr, i, h, tokens, candidate, filled, B, H, TT) < quota)

    # a widened channel re-codes the earlier tokens in place: only the bytes that hold one, as the
    # 4-bit write does (WIDEN_BYTES of them at a time, WIDEN_ROWS tokens at a time); the dropped
    # tokens' slots are read before any new token takes them
    if FRESH:  # nothing stored to re-code
        pass
    elif widened:
        widened_bytes = tl.reshape(tl.max(1 - kept.to(tl.int32), 2), [U])  # 1: a channel of the byte widened
        count = tl.sum(widened_bytes, 0)
        rank = tl.cumsum(widened_bytes, 0) - widened_bytes
        for a0 in range(0, count, WIDEN_BYTES):
            want = a0 + tl.arange(0, WIDEN_BYTES)
            pick = ranked(widened_bytes, rank, want)  # [WIDEN_BYTES, U]
            byte = tl.sum(tl.where(pick, tl.arange(0, U)[None, :], 0), 1)[None, :]
            live = (want < count)[None, :]
            old_zero, old_scale = _bytes_of(k_zero, pick), _bytes_of(k_scale, pick)
            new_zero, new_step = _bytes_of(zero.to(tl.float32), pick), _bytes_of(step.to(tl.float32), pick)
            kept_here = _bytes_of(kept.to(tl.float32), pick) > 0.5
            for t0 in range(0, num_stored, WIDEN_ROWS):
                tt = t0 + tl.arange(0, WIDEN_ROWS)
                earlier = tt < num_stored
                old_slot = tl.load(page + SLOT_OF + h * B + tt, mask=earlier, other=NONE).to(tl.int32)
                k_high, k_low, level = _stored_k(page, h, tt[:, None, None], byte[:, :, None], old_slot,
                                                 (earlier[:, None] & live)[:, :, None], shift, K_HIGH, K_LOW, B, R,
                                                 U, NONE)
                k_codes = tl.minimum(tl.maximum(code_on(level * old_scale + old_zero, new_zero, new_step), 0.0), _TOP)
                k_codes = tl.where(kept_here, k_high * 4 + k_low, k_codes.to(tl.int32))
                keep_t = _pick(keep, tokens, tt) & earlier
                tl.debug_barrier()  # the tile's bytes are read before any is written
                _store_plane(page, K_HIGH, h * B + tt[:, None], byte, k_codes >> 2, shift, earlier[:, None] & live, U)
                _store_plane(page, K_LOW, h * R + tl.where(keep_t, old_slot, 0)[:, None], byte, k_codes, shift,
                             keep_t[:, None] & live, U)
        tl.debug_barrier()

    # the new tokens, NT at a time: codes on the grids, and a kept one takes the lowest free slot
    if DECODE:
        free_slot = _lowest_free_slot(slot, keep & (tokens < num_stored), B)
    elif not FRESH:
        free_gap = _free_slot_gaps(slot, keep & (tokens < num_stored), B)
    taken = num_stored * 0  # new tokens given a slot so far
    for t0 in range(num_stored, filled, NT):
        tt = t0 + tl.arange(0, NT)
        t = tt[:, None, None]
        rows = tt[:, None]
        new = t < filled
        appended = tt < filled
        keep_t = _pick(keep, tokens, tt) & appended
        nth = taken + tl.cumsum(keep_t.to(tl.int32), 0) - 1
        taken += tl.sum(keep_t.to(tl.int32), 0)
        if DECODE:  # its one new token
            new_slot = nth * 0 + free_slot
        elif FRESH:  # every slot free
            new_slot = nth
        else:
            new_slot = nth + tl.sum((free_gap[None, :] <= nth[:, None]).to(tl.int32), 1)  # the nth free slot

        x = tl.load(k_ptr + (first + t - num_stored) * k_row_stride + h * D + ch, mask=new, other=0.0)
        k_codes = tl.minimum(tl.maximum(code_on(x.to(tl.float32), zero.to(tl.float32), step.to(tl.float32)), 0.0),
                             _TOP).to(tl.int32)
        v_new = tl.load(v_ptr + (first + t - num_stored) * v_row_stride + h * D + ch, mask=new, other=0.0)
        v_new = v_new.to(tl.float32)
        v_zero, v_scale = min_max_stats(tl.min(tl.min(tl.where(new, v_new, float("inf")), 2), 1),
                                         tl.max(tl.max(tl.where(new, v_new, float("-inf")), 2), 1), _TOP)
        v_code = code_on(v_new, v_zero.to(tl.float32)[:, None, None], v_scale.to(tl.float32)[:, None, None])
        v_codes = tl.minimum(tl.maximum(v_code, 0.0), _TOP).to(tl.int32)

        tl.store((page + V_ZERO + (h * B + tt) * 2).to(tl.pointer_type(tl.float16)), v_zero, mask=appended)
        tl.store((page + V_SCALE + (h * B + tt) * 2).to(tl.pointer_type(tl.float16)), v_scale, mask=appended)
        _store_plane(page, K_HIGH, h * B + rows, u2, k_codes >> 2, shift, appended[:, None] & (u2 < U), U)
        _store_plane(page, V_HIGH, h * B + rows, u2, v_codes >> 2, shift, appended[:, None] & (u2 < U), U)
        low_row = h * R + tl.where(keep_t, new_slot, 0)[:, None]
        _store_plane(page, K_LOW, low_row, u2, k_codes, shift, keep_t[:, None] & (u2 < U), U)
        _store_plane(page, V_LOW, low_row, u2, v_codes, shift, keep_t[:, None] & (u2 < U), U)
        tl.store(page + SLOT_OF + h * B + tt, tl.where(keep_t, new_slot, NONE).to(tl.uint8), mask=appended)
    # earlier tokens that lost their 4 bits, and the rows that hold no token yet
    dropped = (earlier_salient & ~keep) | (tokens >= filled)
    tl.store(page + SLOT_OF + h * B + tokens, tl.full([B], NONE, tl.uint8), mask=dropped)
    tl.store((page + K_ZERO + (h * D + ch) * 2).to(tl.pointer_type(tl.float16)), zero, mask=ch < D)
    tl.store((page + K_SCALE + (h * D + ch) * 2).to(tl.pointer_type(tl.float16)), step, mask=ch < D)


@triton.jit
def _ranks(scores_ptr, i, h, tokens, candidate, filled, B: tl.constexpr, H: tl.constexpr, TT: tl.constexpr):
    """[B] each token's rank among the block's ``candidate`` tokens (its earlier 4-bit tokens and the
    new ones) by score, ties to the earlier token: the candidates scored above it, counted TT at a
    time."""
    mine = tl.load(scores_ptr + (i * B + tokens) * H + h)
    rank = tl.zeros([B], tl.int32)
    for c0 in range(0, filled, TT):
        cc = c0 + tl.arange(0, TT)
        theirs = tl.load(scores_ptr + (i * B + cc) * H + h)
        rival = _pick(candidate, tokens, cc)
        better = rival[None, :] & ((theirs[None, :] > mine[:, None])
                                   | ((theirs[None, :] == mine[:, None]) & (cc[None, :] < tokens[:, None])))
        rank += tl.sum(better.to(tl.int32), 1)
    return rank


@triton.jit
def _pick(flags, tokens, tt):
    """``flags`` [B] (one a block token) at tokens ``tt`` [T]."""
    return tl.sum(tl.where(tokens[None, :] == tt[:, None], flags.to(tl.int32)[None, :], 0), 1) > 0


@triton.jit
def _lowest_free_slot(slot, holds, B: tl.constexpr):
    """The lowest slot that no token holds (``slot`` where ``holds``), from a bit mask of the held
    slots a 32-bit word at a time (a decode row's one new token: no sort)."""
    word = tl.where(holds, slot >> 5, -1)
    bit = 1 << (slot & 31)  # distinct slots: a word's sum is the OR of its bits
    lowest = tl.full([], B, tl.int32)
    for w in tl.static_range((B + 31) // 32 - 1, -1, -1):  # the lowest word with a free slot wins
        free = ~tl.sum(tl.where(word == w, bit, 0), 0)
        first = free & -free  # its lowest free bit alone; its position is the float's exponent
        at = ((first.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        lowest = tl.where(free != 0, w * 32 + at, lowest)
    return lowest


@triton.jit
def _free_slot_gaps(slot, holds, B: tl.constexpr):
    """[B] the slots still held (``slot`` where ``holds``) in ascending order, each less its place in
    that order: the free slots below it. The nth free slot (from 0) is n plus the count of these
    gaps at most n."""
    held = tl.sort(tl.where(holds, slot, 1 << 20))
    return held - tl.arange(0, B)


def write_constants(fmt: SalientTokensFormat, group: int, tile: int = TILE, probes: int = PROBES) -> dict:
    """The write kernel's compile-time constants for ``fmt``'s pages and ``group`` query heads a KV
    head (``probes`` a product), but for the kind of write (DECODE, GIVEN, NORMALIZED)."""
    at = fmt.regions.start
    return dict(PAGE=fmt.page_bytes, B=fmt.block_size, R=fmt.slots, D=fmt.k.head_size, G=group, H=fmt.k.num_heads,
                K_SCALE=at("k_scale"), K_ZERO=at("k_zero"), V_SCALE=at("v_scale"), V_ZERO=at("v_zero"),
                K_HIGH=at("k_high"), V_HIGH=at("v_high"), K_LOW=at("k_low"), V_LOW=at("v_low"), SLOT_OF=at("slot_of"),
                NONE=NO_SLOT, TT=min(tile, fmt.block_size), PP=probes)


@functools.cache
def _variant(fmt: SalientTokensFormat, group: int, tile: int, num_warps: int, decode: bool, given: bool,
             normalized: bool, fresh: bool, probes: int = PROBES) -> Variant:
    options = {"num_warps": num_warps}
    if decode and torch.version.hip is None:
        options["maxnreg"] = decode_tuning(group).registers
    return Variant(_salient_write_kernel, write_constants(fmt, group, tile, probes)
                   | dict(DECODE=decode, GIVEN=given, NORMALIZED=normalized, FRESH=fresh), options)


_RUNTIME = _salient_write_kernel.arg_names[:_salient_write_kernel.arg_names.index("PAGE")]


def _arguments(programs: int, fmt: SalientTokensFormat, query, key, value, cache, scores,
               kind: tuple[bool, bool, bool, bool], tile: int | None = None, num_warps: int | None = None,
               probes: int | None = None, **args) -> tuple[Variant, tuple[int, int], tuple]:
    """The write kernel's variant, grid (``programs`` blocks or decode rows, every KV head) and runtime
    arguments; ``kind``: its DECODE, GIVEN, NORMALIZED and FRESH; ``tile``, ``num_warps`` and
    ``probes`` (a product) as tuned unless given. Pointers a kind does not read are given the cache's."""
    values = dict(q_ptr=query, k_ptr=key, v_ptr=value, scores_ptr=scores, pages_ptr=cache,
                  q_row_stride=query.stride(0), q_head_stride=query.stride(1), k_row_stride=key.stride(0),
                  v_row_stride=value.stride(0), first_block=0, scale=1.0, interval=1, window=NO_WINDOW,
                  table_stride=0, lse_row_stride=0, lse_head_stride=0) | args
    heads = fmt.k.num_heads
    group = query.shape[1] // heads
    default_tile, default_warps = default_tuning(group, kind[0], kind[3])
    return (_variant(fmt, group, tile or default_tile, num_warps or default_warps, *kind, probes or PROBES),
            (programs, heads), tuple([values.get(name, cache) for name in _RUNTIME]))


def _launch(*args, **kwargs) -> Compiled | None:
    """The write kernel launched with ``_arguments``; the compiled kernel, as ``launch`` returns it."""
    return launch(*_arguments(*args, **kwargs))


# A layer's own tensors, in the order a planned chunk write takes their pointers; the kernel's other
# pointer arguments that a kind does not read are given the cache's.
_LAYER_POINTERS = ("q_ptr", "k_ptr", "v_ptr", "lse_ptr", "pages_ptr")


class _ChunkWritePlan(NamedTuple):
    """A step's chunk writes (one launch a kind of block), compiled (``launch.Compiled``), with their
    arguments as plain values but for a layer's own pointers: a step's later layers launch the
    compiled kernels with their own, without building the arguments again (as ``decode._DecodePlan``)."""
    launches: tuple[tuple[Compiled, tuple[int, int, int], list, tuple[tuple[int, int], ...]], ...]
    scores: torch.Tensor  # the launches' scratch scores, shared by the step's layers (one stream: one at a time)

    @staticmethod
    def of(compiled: Compiled, grid: tuple[int, int], args: tuple) -> tuple:
        """One launch's part of a plan: its arguments, tensors as pointers, and where each of the
        layer's own pointers (``_LAYER_POINTERS``; the cache's where a kind reads none) goes."""
        cache = _LAYER_POINTERS.index("pages_ptr")
        own = tuple((at, _LAYER_POINTERS.index(name) if name in _LAYER_POINTERS else cache)
                    for at, (name, arg) in enumerate(zip(_RUNTIME, args))
                    if name in _LAYER_POINTERS or arg is args[_RUNTIME.index("pages_ptr")])
        plain = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        return compiled, (*grid, 1), plain, own

    def __call__(self, stream: int, pointers: tuple[int, ...]) -> None:
        for compiled, grid, plain, own in self.launches:
            args = plain.copy()
            for at, which in own:
                args[at] = pointers[which]
            compiled.run(grid, stream, args)


def write_decoded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                  fmt: SalientTokensFormat, spec: SalientSpec, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  lse: torch.Tensor, scale: float, window: int | None = None, **tuning) -> None:
    """``salient_torch.write_decoded``'s contract: each decode row's new token (``key``/``value`` [N,
    H, D]) into its last block, scored by its ``query`` [N, Hq, D] with ``lse`` [N, Hq] (its
    attention's log-sum-exp over the whole context, or its sliding ``window``; any strides)."""
    n = query.shape[0]
    if n == 0:
        return
    given = spec.score == "random"
    scores = (last_block_random_scores(seq_lens, fmt.block_size, fmt.k.num_heads, spec) if given else
              torch.empty(n, fmt.block_size, fmt.k.num_heads, device=cache.device))
    _launch(n, fmt, query, key, value, cache, scores, lse_ptr=lse, lse_row_stride=lse.stride(0),
            lse_head_stride=lse.stride(1), table_ptr=block_table,
            lens_ptr=seq_lens, quotas_ptr=quota_table(fmt, cache.device), scale=scale,
            interval=spec.recompress_interval, window=window or NO_WINDOW, table_stride=block_table.stride(0),
            kind=(True, given, False, False), **tuning)


def write_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                 fmt: SalientTokensFormat, spec: SalientSpec, writes: ChunkWrites | None, lse: torch.Tensor,
                 scale: float, window: int | None = None, **tuning) -> None:
    """Each request's step tokens (``key``/``value`` [T, H, D]) into its pages, every block they touch
    re-compressed as ``salient_torch.attend_and_write`` re-compresses one request's, all at once:
    the blocks and probes of ``writes`` (``salient_torch.plan_chunk_writes``), the probes' scores
    from their ``query`` rows and ``lse`` [T, Hq] (any strides), the log-sum-exp of each row's
    attention over its whole context (or its sliding ``window``, which its probe sees alone)."""
    if writes is None:
        return
    layer = (query, key, value, lse, cache)  # as _LAYER_POINTERS
    plan_key = None
    if plannable(cache.device):
        stream = stream_handle(cache.device)
        pointers = tuple([x.data_ptr() for x in layer])
        # kept on ``writes``, which is one format's and spec's: the rest of what the launches depend on
        plan_key = (query.shape, query.dtype, key.dtype, query.stride(0), query.stride(1), key.stride(0),
                    value.stride(0), lse.stride(0), lse.stride(1), scale, window, tuple(sorted(tuning.items())), stream,
                    tuple([p & 15 == 0 for p in pointers]))  # the compiled kernels' specialization
        plan = writes.launch_plans.get(plan_key)
        if plan is not None:
            plan(stream, pointers)
            return
    n = writes.blocks.shape[0]
    scores = writes.scores
    if scores is None:
        scores = torch.empty(n, fmt.block_size, fmt.k.num_heads, device=cache.device)
    given, normalized = writes.scores is not None, spec.score == "normalized"
    launches = []
    # the fresh blocks (the plan puts them first) through the kernel without stored tokens, the rest after
    for first, end, fresh in ((0, writes.fresh, True), (writes.fresh, n, False)):
        if end > first:
            variant, grid, args = _arguments(
                end - first, fmt, query, key, value, cache, scores, lse_ptr=lse, lse_row_stride=lse.stride(0),
                lse_head_stride=lse.stride(1), blocks_ptr=writes.blocks, stored_ptr=writes.num_stored,
                filled_ptr=writes.filled, first_ptr=writes.first_row, quota_ptr=writes.quota, start_ptr=writes.start,
                probe_first_ptr=writes.probe_first, probe_end_ptr=writes.probe_end, probe_rows_ptr=writes.probe_rows,
                probe_pos_ptr=writes.probe_pos, first_block=first, scale=scale, window=window or NO_WINDOW,
                kind=(False, given, normalized, fresh), **tuning)
            launches.append((launch(variant, grid, args), grid, args))
    if plan_key is not None and all(compiled is not None for compiled, _, _ in launches):
        writes.launch_plans[plan_key] = _ChunkWritePlan(
            tuple(_ChunkWritePlan.of(*launched) for launched in launches), scores)


def warm_up(cache: torch.Tensor, fmt: SalientTokensFormat, num_query_heads: int, dtype: torch.dtype) -> None:
    """Compile every kind of write (decode rows; prompt chunks with scores drawn, normalized or
    accumulated) as serving launches them, before serving: launches of no program, which write
    nothing."""
    heads, d = fmt.k.num_heads, fmt.k.head_size
    q = torch.zeros(1, num_query_heads, d, dtype=dtype, device=cache.device)
    new = torch.zeros(1, heads, d, dtype=dtype, device=cache.device)
    one = torch.zeros(1, 1, dtype=torch.int32, device=cache.device)
    lse = torch.zeros(num_query_heads, 1, dtype=torch.float32, device=cache.device).t()
    common = dict(lse_ptr=lse, lse_row_stride=lse.stride(0), lse_head_stride=lse.stride(1), scale=1.0)
    for given in (False, True):
        _launch(0, fmt, q, new, new, cache, lse, (True, given, False, False), table_ptr=one, lens_ptr=one,
                quotas_ptr=quota_table(fmt, cache.device), **common)
    chunks = {f"{name}_ptr": one for name in ("blocks", "stored", "filled", "first", "quota", "start", "probe_first",
                                               "probe_end", "probe_rows", "probe_pos")}
    for given, normalized in ((True, False), (False, True), (False, False)):
        for fresh in (False, True):
            _launch(0, fmt, q, new, new, cache, lse, (False, given, normalized, fresh), **chunks, **common)
