"""Cache write: quantize, pack and store new tokens into their pages.

Writes the bytes ``paged_torch.write_tokens`` writes (divisions and square roots
are IEEE-rounded, ``div_rn`` / ``sqrt_rn``, so they match the torch reference),
with as little work as the format allows. Programs per (token, KV head), one
launch for K and V (V in the first of a token's K shares):

- statistics per token (V, KIVI), or 16-bit rows: the token's program encodes its
  own row. Earlier rows keep their codes: re-encoding them would give the same
  bytes, as their statistics don't change.
- statistics per channel over the block (K, KIVI), under the format's append rule
  (``MinMaxCodec.encode``): the programs of the block's last new token handle the
  block, a chunk of channels at a time (channels are independent). A single token
  appended to stored ones (decoding) is first coded on the stored grids and the
  storage units whose values all fit are written; only the units where a value
  left its grid are re-encoded (the earlier tokens read back from the page, the
  statistics of the channels that no longer fit widened to span their stored
  grid and the new value, and a margin past it), gathered a chunk at a time.
  The widened statistics need no pass over the rows, so each earlier row's
  codes are requantized on their own. A program's work follows the number of
  widened channels, and a prefill's tokens other than each block's last cost one
  slot load.
- ZipCache channel scales (V): the block's last new token re-encodes the whole
  block, as every row's statistics depend on the block-wide channel scales.
- outlier tokens (``formats.outliers``): ``outlier_select`` first chooses the
  outliers of the blocks this step opens and stores their offsets; the block's
  encoding leaves those rows out of K's statistics (their codes are never read).

Values sit in registers as ``[ROWS, UNITS, PER]``: token, storage unit (a byte;
at 3 bits the two planes' bytes of 8 channels, ``addressing``) and position
inside the unit; channel ``unit * VALS + position``. Packing is then a shifted
sum over the last axis.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.formats.layout import TensorLayout, page_layout
from vllm_kvcompress.formats.codecs import CLIP_DENOMINATOR, EPS, WIDEN_MARGIN

from .addressing import load_units, pack_units, store_units, unpack_codes
from .grid import code_on, min_max_stats
from .launch import Variant, launch
from .outlier_select import choose_outliers

# where statistics are per channel: channels re-encoded together, and programs a block's chunks are
# dealt out to (so the program of a token that widened many channels, or of a prefill block, does
# not run 32 chunks one after the other). Swept on an H200 (docs/benchmarks.md): a decode step's
# write at batch 64 took 36.8 us with these, 40.0 / 51.6 with 2 / 8 channels, 43.0 / 35.6 / 44.0
# with 1 / 2 / 8 programs (MHA, 4/4, 4 warps; 2 warps, the default, 32.2)
CHUNK_CHANNELS = 4
SPREAD = 4
# registers a thread may hold in the per-channel write (codes of any width). The compiler's own
# choice (72 for K's kernel alone, 89 to 96 with V's write in it) lets at most 14 programs share an
# SM, and a decode step's write waits on memory in short programs, so more of them at once hide
# more of it. H200, a decode step of 144 requests (4/4, MHA): 53.0 us uncapped, 39.8 / 38.2 / 37.9
# at 32 / 40 / 48 (GQA 19.0 -> 17.0 at 40; 2/2 35.0 -> 25.6, 8/8 61.8 -> 40.4). 3-bit codes gain
# most (H100, the same step: quant-k3v2-o1 122.3 -> 67.9 us, quant-k3v3 111.6 -> 58.8, GQA
# quant-k3v2-o1 40.4 -> 31.5). A prefill chunk's write (2,048 tokens, MHA), H100: 4/4 187.4 -> 178.8,
# quant-k3v3 312.7 -> 224.7, quant-k3v2-o1 401.7 -> 342.1 (on an H200 4/4 had slowed, 185.8 -> 196.2).
# Not applied on ROCm (no such option).
REGISTER_CAP = 40
# (tokens x KV heads) above which a step's write deals each block's chunks over the programs of the
# block's last new tokens, one program a (token, head), instead of over SPREAD programs of every
# token: in a prefill most tokens have no K work, and their empty programs cost more than the work
DEALT_PROGRAMS = 8192
# a decoding token's re-encode in a dealt step (a decode row beside prompts), where one program does
# the work of SPREAD shares: storage units gathered into one re-encode (in shares, a chunk's units).
# H200, 4/4, a step of 144 decodes and 2 prompts of 450 tokens: MHA 145.4 -> 138.3 us, GQA 53.9 ->
# 45.0. In shares, wider gathers were slower (a decode step of 144, MHA: 45.9 us; 71.0 with 8 units)
APPEND_UNITS = 8
_WIDEN_MARGIN = tl.constexpr(WIDEN_MARGIN)
_EPS = tl.constexpr(EPS)
_CLIP_DENOMINATOR = tl.constexpr(CLIP_DENOMINATOR)


@triton.jit
def _widened_span(lo, hi, zero, grid_top):
    """Bounds of a widened channel's grid: its stored grid ``zero .. grid_top`` and its new values
    ``lo .. hi``, moved out by WIDEN_MARGIN of the span on each side they pass (``codecs.widened_span``)."""
    a = tl.minimum(lo, zero)
    b = tl.maximum(hi, grid_top)
    margin = (b - a) * _WIDEN_MARGIN
    return tl.where(lo < zero, a - margin, a), tl.where(hi > grid_top, b + margin, b)


@triton.jit
def _least_error_span(x, weight, mn, mx, top: tl.constexpr):
    """Per channel of ``x`` [ROWS, UC, PER], ``mn .. mx`` shrunk about its middle by the ratio
    ``1 - k / CLIP_DENOMINATOR`` (k = 0 .. CLIP_DENOMINATOR / 2) whose grid has the least squared
    error, each value's weighted by its squared distance from the middle and each row's counted
    ``weight`` [ROWS, 1, 1] times (``MinMaxCodec._least_error_span``)."""
    mid = (mn + mx) * 0.5
    half = (mx - mn) * 0.5
    weight = weight * (x - mid) * (x - mid)
    best_lo = mn
    best_hi = mx
    least = tl.full(mn.shape, float("inf"), tl.float32)
    for k in tl.static_range(_CLIP_DENOMINATOR // 2 + 1):
        if k == 0:
            lo = mn
            hi = mx
        else:
            shrunk = (1.0 - k / _CLIP_DENOMINATOR) * half
            lo = mid - shrunk
            hi = mid + shrunk
        zero, step = min_max_stats(lo, hi, top)
        zero = zero.to(tl.float32)
        step = step.to(tl.float32)
        codes = tl.minimum(tl.maximum(code_on(x, zero, step), 0.0), top)
        error = codes * step + zero - x
        error = tl.sum(weight * (error * error), 0)[None, :, :]
        better = error < least
        least = tl.where(better, error, least)
        best_lo = tl.where(better, lo, best_lo)
        best_hi = tl.where(better, hi, best_hi)
    return best_lo, best_hi


@triton.jit
def _half(byte_ptr, mask, other):
    """float16 values at byte addresses ``byte_ptr``, as float32."""
    return tl.load(byte_ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=other).to(tl.float32)


@triton.jit
def _encode_rows(src_ptr, src_stride, t, j, is_new, valid, page, h, units, units_ok,
                 D: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, VALS: tl.constexpr, UC: tl.constexpr,
                 PER: tl.constexpr, CODES: tl.constexpr, ROW: tl.constexpr, SCALE: tl.constexpr,
                 ZERO: tl.constexpr, CS: tl.constexpr, PER_CHANNEL: tl.constexpr, GROUP: tl.constexpr,
                 KEPT: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr, CLIP: tl.constexpr):
    """Encode rows ``t`` (block offsets, [ROWS]) of storage units ``units`` ([UC], those where
    ``units_ok``) of one head's tensor. Row r takes its values from source row ``j[r]`` where
    ``is_new[r]``, else from the page; statistics cover the rows where ``valid[r]``. KEPT >= 0
    (statistics per channel): the page's outlier offsets [H, KC] int16 there; new rows among them
    stay out of the statistics. CLIP (with KEPT): a block's first write narrows its channels' grids
    (``_least_error_span``), counting each outlier row as the reference does, as its first other row."""
    t2 = t[:, None]
    u2 = units[None, :]
    unit_ok = units_ok[None, :, None] & (u2[:, :, None] * VALS < D)
    t = t[:, None, None]
    u = u2[:, :, None]
    p = tl.arange(0, PER)[None, None, :]
    ch = u * VALS + p
    ch_ok = (p < VALS) & (ch < D) & unit_ok
    top: tl.constexpr = (1 << BITS) - 1.0
    is_new = is_new[:, None, None]
    valid = valid[:, None, None]
    stored = valid & (is_new == 0)
    newm = is_new & ch_ok
    oldm = stored & ch_ok
    stat_new = newm
    if KEPT >= 0:
        c = tl.arange(0, KCP)
        kept = tl.load((page + KEPT).to(tl.pointer_type(tl.int16)) + h * KC + c, mask=c < KC, other=-1).to(tl.int32)
        is_kept = tl.sum((t2 == kept[None, :]).to(tl.int32), 1) > 0
        stat_new = newm & (is_kept == 0)[:, None, None]
    x_new = tl.load(src_ptr + j[:, None, None] * src_stride + h * D + ch, mask=newm, other=0.0).to(tl.float32)

    # earlier tokens, decoded from the page (a new row's stored bytes are not read: with statistics
    # per token its units lie 16 bytes apart, a sector for every two)
    unit = load_units(page, CODES, t, h, u, ROW, BLOCK, BITS, GROUP, stored & unit_ok)
    old_codes = unpack_codes(unit, p, BITS)
    if PER_CHANNEL:
        sz = (h * D + ch) * 2
        scale = _half(page + SCALE + sz, ch_ok, 0.0)
        zero = _half(page + ZERO + sz, ch_ok, 0.0)
    else:
        sz = (h * BLOCK + t) * 2  # per-token statistics are head-major
        scale = _half(page + SCALE + sz, stored, 0.0)
        zero = _half(page + ZERO + sz, stored, 0.0)
    x_old = old_codes * scale + zero
    if CS >= 0:
        x_old = x_old * _half(page + CS + (h * D + ch) * 2, ch_ok, 1.0)
    x = tl.where(newm, x_new, tl.where(oldm, x_old, 0.0))
    rows_ok = valid & ch_ok

    if CS >= 0:  # ZipCache: divide channels by sqrt(max |x|) over the block
        amax = tl.max(tl.where(rows_ok, tl.abs(x), 0.0), 0)[None, :, :]
        cs = tl.sqrt_rn(tl.maximum(amax, _EPS)).to(tl.float16)
        tl.store((page + CS + (h * D + ch) * 2).to(tl.pointer_type(tl.float16)), cs, mask=ch_ok)
        x = tl.math.div_rn(x, cs.to(tl.float32) + tl.zeros_like(x))
    if PER_CHANNEL and CS < 0:  # new rows, widened to span the stored grid where there is one
        has_old = tl.max(stored.to(tl.int32)) > 0
        mn = tl.min(tl.where(stat_new, x, float("inf")), 0)[None, :, :]
        mx = tl.max(tl.where(stat_new, x, float("-inf")), 0)[None, :, :]
        lo, hi = _widened_span(mn, mx, zero, zero + scale * top)
        mn = tl.where(has_old, lo, mn)
        mx = tl.where(has_old, hi, mx)
    elif PER_CHANNEL:
        mn = tl.min(tl.where(rows_ok, x, float("inf")), 0)[None, :, :]
        mx = tl.max(tl.where(rows_ok, x, float("-inf")), 0)[None, :, :]
    else:
        mn = tl.min(tl.min(tl.where(rows_ok, x, float("inf")), 2), 1)[:, None, None]
        mx = tl.max(tl.max(tl.where(rows_ok, x, float("-inf")), 2), 1)[:, None, None]
    mn = tl.where(mn == float("inf"), 0.0, mn)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    if CLIP:  # on the block's first write, of two tokens or more (one value keeps its plain grid at
        # every ratio: a decoding token's new block skips the search); an append widens as without
        if (tl.sum((valid & is_new).to(tl.int32)) > 1) & (has_old == 0):
            # the reference's rows: an outlier's holds its head's first other row's values
            row = tl.reshape(t2, (t2.shape[0],))
            first_other = tl.min(tl.where(is_kept, BLOCK, row), 0)
            weight = tl.where(is_kept, 0.0, 1.0) + tl.where(row == first_other, tl.sum(is_kept.to(tl.float32), 0), 0.0)
            mn, mx = _least_error_span(x, tl.where(valid & is_new, weight[:, None, None], 0.0), mn, mx, top)
    zero_h, scale_h = min_max_stats(mn, mx, top)
    if PER_CHANNEL and CS < 0:  # append rule: channels whose new values fit their grid keep it
        q_old = code_on(x_new, zero, scale)
        off_grid = tl.max((newm & ((q_old < 0.0) | (q_old > top))).to(tl.int32), 0)[None, :, :]
        keep = (off_grid == 0) & has_old
        zero_h = tl.where(keep, zero.to(tl.float16), zero_h)
        scale_h = tl.where(keep, scale.to(tl.float16), scale_h)
    codes = tl.minimum(tl.maximum(code_on(x, zero_h.to(tl.float32), scale_h.to(tl.float32)), 0.0), top)
    if PER_CHANNEL and CS < 0:
        codes = tl.where(keep & oldm, old_codes, codes)
    codes = tl.where(rows_ok, codes, 0.0).to(tl.uint32)
    packed = pack_units(codes, p, 2, BITS)  # [ROWS, UC]; disjoint bits, below 2^32
    store_units(page, CODES, t2, h, u2, ROW, BLOCK, BITS, GROUP, packed, (u2 * VALS < D) & units_ok[None, :])
    if PER_CHANNEL:  # statistics [1, UC, PER]
        tl.store((page + SCALE + sz).to(tl.pointer_type(tl.float16)), scale_h, mask=ch_ok)
        tl.store((page + ZERO + sz).to(tl.pointer_type(tl.float16)), zero_h, mask=ch_ok)
    else:  # statistics [ROWS, 1, 1]
        tl.store((page + SCALE + sz).to(tl.pointer_type(tl.float16)), scale_h, mask=valid)
        tl.store((page + ZERO + sz).to(tl.pointer_type(tl.float16)), zero_h, mask=valid)


@triton.jit
def _append_on_grid(src_ptr, src_stride, i, off, page, h, units, D: tl.constexpr,
                    BLOCK: tl.constexpr, BITS: tl.constexpr, VALS: tl.constexpr, PER: tl.constexpr,
                    CODES: tl.constexpr, ROW: tl.constexpr, SCALE: tl.constexpr, ZERO: tl.constexpr):
    """Decoding's common case under per-channel statistics: token ``i`` goes to block offset ``off``
    on its channels' stored grids, for storage units ``units`` (the ones this program's share owns;
    a share reads and writes only its own channels, so shares don't race). Writes the units whose
    every value fits its grid and returns, per unit, 1 where a value did not (the caller re-encodes
    those), else 0."""
    u = units[:, None]
    p = tl.arange(0, PER)[None, :]
    ch = u * VALS + p
    ch_ok = (p < VALS) & (ch < D)
    top: tl.constexpr = (1 << BITS) - 1.0
    x = tl.load(src_ptr + i * src_stride + h * D + ch, mask=ch_ok, other=0.0).to(tl.float32)
    sz = (h * D + ch) * 2
    q = code_on(x, _half(page + ZERO + sz, ch_ok, 0.0), _half(page + SCALE + sz, ch_ok, 1.0))
    misfit = tl.max((ch_ok & ((q < 0.0) | (q > top))).to(tl.int32), 1)
    packed = pack_units(tl.where(ch_ok & (misfit[:, None] == 0), q, 0.0).to(tl.uint32), p, 1, BITS)
    store_units(page, CODES, off, h, units, ROW, BLOCK, BITS, 0, packed, (units * VALS < D) & (misfit == 0))
    return misfit


@triton.jit
def _widen_units(src_ptr, src_stride, i, off, page, h, units, units_ok, D: tl.constexpr, BLOCK: tl.constexpr,
                 BITS: tl.constexpr, VALS: tl.constexpr, PER: tl.constexpr, CODES: tl.constexpr, ROW: tl.constexpr,
                 SCALE: tl.constexpr, ZERO: tl.constexpr, RT: tl.constexpr):
    """Decoding's re-encode under per-channel statistics: token ``i`` at block offset ``off`` fell
    off the grid of a channel of each of storage units ``units`` (those where ``units_ok``). Such a
    channel widens to span its stored grid and the new value, so its statistics need no pass over
    the rows, and its earlier codes are requantized onto the widened grid, every row on its own,
    ``RT`` rows at a time up to ``off``; the unit's other channels keep grid and codes."""
    u = units[None, :, None]
    p = tl.arange(0, PER)[None, None, :]
    ch = u * VALS + p
    ch_ok = (p < VALS) & (ch < D) & units_ok[None, :, None]
    top: tl.constexpr = (1 << BITS) - 1.0
    sz = (h * D + ch) * 2
    zero = _half(page + ZERO + sz, ch_ok, 0.0)
    scale = _half(page + SCALE + sz, ch_ok, 1.0)
    x = tl.load(src_ptr + i * src_stride + h * D + ch, mask=ch_ok, other=0.0).to(tl.float32)
    q = code_on(x, zero, scale)
    widen = ch_ok & ((q < 0.0) | (q > top))
    wide_zero, wide_scale = min_max_stats(*_widened_span(x, x, zero, zero + scale * top), top)
    new_zero = tl.where(widen, wide_zero.to(tl.float32), zero)
    new_step = tl.where(widen, wide_scale.to(tl.float32), scale)
    unit_ok = units_ok[None, :] & (units[None, :] * VALS < D)
    for r0 in range(0, off + 1, RT):
        t2 = r0 + tl.arange(0, RT)[:, None]
        t = t2[:, :, None]
        unit = load_units(page, CODES, t2, h, units[None, :], ROW, BLOCK, BITS, 0, (t2 < off) & unit_ok)[:, :, None]
        old_codes = unpack_codes(unit, p, BITS)
        values = tl.where(t == off, x, old_codes * scale + zero)
        codes = tl.minimum(tl.maximum(code_on(values, new_zero, new_step), 0.0), top)
        codes = tl.where(widen | (t == off), codes, old_codes)
        packed = pack_units(tl.where(ch_ok, codes, 0.0).to(tl.uint32), p, 2, BITS)
        store_units(page, CODES, t2, h, units[None, :], ROW, BLOCK, BITS, 0, packed, (t2 <= off) & unit_ok)
    tl.debug_barrier()  # every thread has read the stored statistics before they are replaced
    tl.store((page + SCALE + sz).to(tl.pointer_type(tl.float16)), wide_scale, mask=widen)
    tl.store((page + ZERO + sz).to(tl.pointer_type(tl.float16)), wide_zero, mask=widen)


@triton.jit
def ranked(flags, rank, want):
    """[W, N]: which of N entries is each ``want`` [W]-th of those ``flags`` (1) marks, ``rank`` [N]
    counting the marked entries before each (``cumsum(flags) - flags``)."""
    return (rank[None, :] == want[:, None]) & (flags[None, :] == 1)


@triton.jit
def _append_token(src_ptr, src_stride, i, off, share, shares, page, h, D: tl.constexpr, BLOCK: tl.constexpr,
                  BITS: tl.constexpr, VALS: tl.constexpr, UNITS: tl.constexpr, PER: tl.constexpr, UC: tl.constexpr,
                  OWN: tl.constexpr, CODES: tl.constexpr, ROW: tl.constexpr, SCALE: tl.constexpr, ZERO: tl.constexpr,
                  AG: tl.constexpr, RT: tl.constexpr):
    """One token appended to stored ones under per-channel statistics (decoding): token i at block
    offset ``off`` goes onto its channels' stored grids, and only share ``share``'s units (its
    chunks of UC) where a value left its grid are re-encoded, AG at a time (gathered by rank among
    them), RT rows at a time."""
    k = tl.arange(0, OWN)
    own_units = (k // UC) * (shares * UC) + share * UC + k % UC
    misfit = _append_on_grid(src_ptr, src_stride, i, off, page, h, own_units, D, BLOCK, BITS, VALS, PER,
                             CODES, ROW, SCALE, ZERO)
    count = tl.sum(misfit)
    rank = tl.cumsum(misfit, 0) - misfit
    for first in range(0, count, AG):
        want = first + tl.arange(0, AG)
        units = tl.sum(tl.where(ranked(misfit, rank, want), own_units[None, :], 0), 1)
        _widen_units(src_ptr, src_stride, i, off, page, h, units, want < count, D, BLOCK, BITS,
                     VALS, PER, CODES, ROW, SCALE, ZERO, RT)


@triton.jit
def _block_window(slot_ptr, num_tokens, i, off, blk, BLOCK: tl.constexpr):
    """Token i's block ``blk`` seen from i (at block offset ``off``): each offset t, the batch token
    j that would hold it (a request's new tokens are consecutive), and whether it does."""
    t = tl.arange(0, BLOCK)
    j = i + (t - off)
    in_batch = (j >= 0) & (j < num_tokens)
    is_new = in_batch & (tl.load(slot_ptr + j, mask=in_batch, other=-1).to(tl.int64) == blk * BLOCK + t)
    return t, j, is_new


@triton.jit
def _encode_chunks(src_ptr, src_stride, t, j, is_new, last, first, step, page, h, D: tl.constexpr,
                   BLOCK: tl.constexpr, BITS: tl.constexpr, VALS: tl.constexpr, UNITS: tl.constexpr,
                   PER: tl.constexpr, UC: tl.constexpr, CODES: tl.constexpr, ROW: tl.constexpr,
                   SCALE: tl.constexpr, ZERO: tl.constexpr, CS: tl.constexpr, PER_CHANNEL: tl.constexpr,
                   GROUP: tl.constexpr, KEPT: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr, CLIP: tl.constexpr):
    """Encode the block's rows up to offset ``last`` (``_block_window``'s t, j, is_new), for the
    chunks of UC units starting at unit ``first``, every ``step`` units (channels are independent)."""
    for unit in range(first, UNITS, step):
        units = unit + tl.arange(0, UC)
        _encode_rows(src_ptr, src_stride, t, j, is_new, t <= last, page, h, units, units < UNITS, D,
                     BLOCK, BITS, VALS, UC, PER, CODES, ROW, SCALE, ZERO, CS, PER_CHANNEL, GROUP, KEPT, KC, KCP, CLIP)


@triton.jit
def _write_tensor(src_ptr, src_stride, slot_ptr, num_tokens, i, h, share, shares, slot, page,
                  H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, VALS: tl.constexpr,
                  UNITS: tl.constexpr, PER: tl.constexpr, UC: tl.constexpr, OWN: tl.constexpr,
                  CODES: tl.constexpr, ROW: tl.constexpr, SCALE: tl.constexpr, ZERO: tl.constexpr, CS: tl.constexpr,
                  PER_CHANNEL: tl.constexpr, GROUP: tl.constexpr, AG: tl.constexpr, RT: tl.constexpr,
                  DEAL: tl.constexpr, KEPT: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr, CLIP: tl.constexpr):
    """Token i's write of one tensor (K or V) for head h, as share ``share`` of ``shares``. Where
    statistics are per channel, the block's chunks of UC units are dealt out over the shares (share
    s takes every shares-th chunk, OWN units in all), so a block's re-encoding runs in that many
    programs at once; a decoding token's widened units are requantized AG units and RT rows at a
    time. With DEAL > 1 (a prefill's write, one share), the chunks are dealt out over the programs
    of the block's last DEAL new tokens instead. KEPT >= 0: the page's outlier offsets (``_encode_rows``)."""
    blk = slot // BLOCK
    off = slot % BLOCK
    if BITS == 16:  # the model's own values
        d = tl.arange(0, D)
        dst = (page + CODES + (off * H + h) * ROW).to(src_ptr.dtype) + d
        tl.store(dst, tl.load(src_ptr + i * src_stride + h * D + d))
    elif DEAL > 1:  # (set only where statistics are per channel, without ZipCache channel scales)
        # tokens further than DEAL from their block's last new one stop here (a request's new tokens
        # are consecutive in the batch, so the token DEAL ahead on the same block is the DEAL-th next)
        ahead = tl.load(slot_ptr + i + DEAL, mask=i + DEAL < num_tokens, other=-1).to(tl.int64)
        if (ahead != slot + DEAL) | (off + DEAL >= BLOCK):
            t, j, is_new = _block_window(slot_ptr, num_tokens, i, off, blk, BLOCK)
            last = tl.max(tl.where(is_new, t, -1), 0)
            count = tl.sum(is_new.to(tl.int32), 0)
            dealers = tl.minimum(count, DEAL)
            rank = last - off  # 0 for the block's last new token
            if rank < dealers:
                if (count == 1) & (off > 0):
                    _append_token(src_ptr, src_stride, i, off, share, shares, page, h, D, BLOCK, BITS, VALS,
                                  UNITS, PER, UC, OWN, CODES, ROW, SCALE, ZERO, AG, RT)
                else:
                    _encode_chunks(src_ptr, src_stride, t, j, is_new, last, (rank * shares + share) * UC,
                                   dealers * shares * UC, page, h, D, BLOCK, BITS, VALS, UNITS, PER, UC, CODES, ROW,
                                   SCALE, ZERO, CS, PER_CHANNEL, GROUP, KEPT, KC, KCP, CLIP)
    elif PER_CHANNEL or CS >= 0:  # block-wide statistics: the block's last new token re-encodes it
        nxt = tl.load(slot_ptr + i + 1, mask=i + 1 < num_tokens, other=-1).to(tl.int64)
        if (nxt < 0) | (nxt // BLOCK != blk):
            prev = tl.load(slot_ptr + i - 1, mask=i > 0, other=-1).to(tl.int64)
            if (off > 0) & (prev != slot - 1) & (CS < 0):  # (CS < 0 here: statistics per channel)
                _append_token(src_ptr, src_stride, i, off, share, shares, page, h, D, BLOCK, BITS, VALS,
                              UNITS, PER, UC, OWN, CODES, ROW, SCALE, ZERO, AG, RT)
            else:
                t, j, is_new = _block_window(slot_ptr, num_tokens, i, off, blk, BLOCK)
                _encode_chunks(src_ptr, src_stride, t, j, is_new, off, share * UC, shares * UC, page, h, D, BLOCK,
                               BITS, VALS, UNITS, PER, UC, CODES, ROW, SCALE, ZERO, CS, PER_CHANNEL, GROUP, KEPT, KC,
                               KCP, CLIP)
    else:  # statistics per token: only its own row changes
        one = tl.arange(0, 1)
        all_units = tl.arange(0, UNITS)
        _encode_rows(src_ptr, src_stride, off + one, i + one, one == 0, one == 0, page, h, all_units,
                     all_units < UNITS, D, BLOCK, BITS, VALS, UNITS, PER, CODES, ROW, SCALE, ZERO, CS,
                     PER_CHANNEL, GROUP, -1, 0, 1, False)


# a step's token count is not specialized on (1, multiples of 16): no compile in the middle of serving
@triton.jit(do_not_specialize=["num_tokens"])
def _write_kernel(k_ptr, v_ptr, slot_ptr, cache_ptr, num_tokens, page_bytes, k_stride, v_stride,
                  H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                  K_BITS: tl.constexpr, K_VALS: tl.constexpr, K_UNITS: tl.constexpr, K_PER: tl.constexpr,
                  K_UC: tl.constexpr, K_OWN: tl.constexpr, K_CODES: tl.constexpr, K_ROW: tl.constexpr,
                  K_SCALE: tl.constexpr, K_ZERO: tl.constexpr, K_CS: tl.constexpr, K_PER_CHANNEL: tl.constexpr,
                  K_GROUP: tl.constexpr, K_AG: tl.constexpr, K_RT: tl.constexpr, K_DEAL: tl.constexpr,
                  K_KEPT: tl.constexpr, K_KC: tl.constexpr, K_KCP: tl.constexpr, K_CLIP: tl.constexpr,
                  HAS_V: tl.constexpr,
                  V_BITS: tl.constexpr, V_VALS: tl.constexpr, V_UNITS: tl.constexpr, V_PER: tl.constexpr,
                  V_UC: tl.constexpr, V_OWN: tl.constexpr, V_CODES: tl.constexpr, V_ROW: tl.constexpr,
                  V_SCALE: tl.constexpr, V_ZERO: tl.constexpr, V_CS: tl.constexpr, V_PER_CHANNEL: tl.constexpr,
                  V_GROUP: tl.constexpr, V_AG: tl.constexpr, V_RT: tl.constexpr, V_DEAL: tl.constexpr,
                  V_KEPT: tl.constexpr, V_KC: tl.constexpr, V_KCP: tl.constexpr, V_CLIP: tl.constexpr):
    """Program (token i, head h, share s) writes K as share s of the grid's third axis, and, in
    share 0, V (one launch for both: V's own launch cost a decode step of 144 requests 15.6 us on
    an H200, MHA 4/4)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    share = tl.program_id(2)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if slot >= 0:
        page = cache_ptr + (slot // BLOCK) * page_bytes
        _write_tensor(k_ptr, k_stride, slot_ptr, num_tokens, i, h, share, tl.num_programs(2), slot, page, H, D, BLOCK,
                      K_BITS, K_VALS, K_UNITS, K_PER, K_UC, K_OWN, K_CODES, K_ROW, K_SCALE, K_ZERO, K_CS,
                      K_PER_CHANNEL, K_GROUP, K_AG, K_RT, K_DEAL, K_KEPT, K_KC, K_KCP, K_CLIP)
        if HAS_V:
            if share == 0:
                _write_tensor(v_ptr, v_stride, slot_ptr, num_tokens, i, h, 0, 1, slot, page, H, D, BLOCK,
                              V_BITS, V_VALS, V_UNITS, V_PER, V_UC, V_OWN, V_CODES, V_ROW, V_SCALE, V_ZERO, V_CS,
                              V_PER_CHANNEL, V_GROUP, V_AG, V_RT, V_DEAL, V_KEPT, V_KC, V_KCP, V_CLIP)


def _geometry(bits: int, d: int) -> tuple[int, int, int]:
    """(values per unit, units per row padded to a power of two, values per unit padded)."""
    if bits == 16:
        return 1, 1, 1
    vals = 8 if bits == 3 else 8 // bits
    return vals, triton.next_power_of_2(-(-d // vals)), triton.next_power_of_2(vals)


def _tensor_constants(fmt: KVPageFormat, codec, lay: TensorLayout, chunk_channels: int, spread: int,
                      append_units: int, warps: int, dealt: bool) -> tuple[dict, int]:
    """One tensor's constants of the write kernel (unprefixed), and how many shares its work takes.
    ``dealt``: a block's chunks go to the programs of its last new tokens, one share each."""
    per_channel = codec.bits != 16 and codec.axis == "channel"
    vals, units, per = _geometry(lay.bits, fmt.k.head_size)
    chunk, shares, deal = units, 1, 1  # statistics per token or ZipCache channel scales: whole rows
    if per_channel and lay.channel_scale < 0:  # channels are independent: chunks of them, dealt out
        chunk = min(units, triton.next_power_of_2(max(1, chunk_channels // vals)))
        if dealt:
            deal = units // chunk
        else:
            shares = min(spread, units // chunk)
    gathered = max(chunk, min(units, triton.next_power_of_2(append_units))) if dealt else chunk
    rows_per_tile = min(fmt.block_size, max(8, 32 * warps // (chunk * per)))  # about one value a thread in a chunk
    # outlier tokens leave the statistics per channel (K's); per token, a row's statistics are its own
    kept = fmt.outlier_at("index") if fmt.outliers and per_channel and lay.channel_scale < 0 else -1
    return dict(BITS=lay.bits, VALS=vals, UNITS=units, PER=per, UC=chunk, OWN=units // shares, CODES=lay.codes,
                ROW=lay.row_bytes, SCALE=lay.scale, ZERO=lay.zero, CS=lay.channel_scale, PER_CHANNEL=per_channel,
                GROUP=lay.token_group, AG=gathered, RT=rows_per_tile, DEAL=deal, KEPT=kept, KC=fmt.outliers,
                KCP=triton.next_power_of_2(max(fmt.outliers, 1)), CLIP=getattr(codec, "clip", False) and kept >= 0), shares


@functools.cache
def _write_variant(fmt: KVPageFormat, chunk_channels: int, spread: int, append_units: int, num_warps: int | None,
                   dealt: bool) -> tuple[Variant, int]:
    """The write kernel's variant for a page format, and its programs per (token, head): K's shares
    (V is written in share 0). ``dealt``: for a prefill's many tokens (see DEALT_PROGRAMS)."""
    lay = page_layout(fmt)
    quantized = lay.k.bits != 16 or (lay.v is not None and lay.v.bits != 16)
    warps = num_warps or (2 if quantized else 1)  # 16-bit rows only copy
    k, shares = _tensor_constants(fmt, fmt.k, lay.k, chunk_channels, spread, append_units, warps, dealt)
    v = k if lay.v is None else _tensor_constants(fmt, fmt.v, lay.v, chunk_channels, 1, append_units, warps, dealt)[0]
    constants = dict(H=fmt.k.num_heads, D=fmt.k.head_size, BLOCK=fmt.block_size, HAS_V=lay.v is not None,
                     **{f"K_{name}": value for name, value in k.items()},
                     **{f"V_{name}": value for name, value in v.items()})
    # unfused: a*b+c as one FMA rounds once where the reference rounds twice (a requantized code
    # at a rounding boundary would differ from the reference's)
    options = {"num_warps": warps, "enable_fp_fusion": False}
    if k["PER_CHANNEL"] and k["CS"] < 0 and torch.version.hip is None:
        options["maxnreg"] = REGISTER_CAP
    return Variant(_write_kernel, constants, options), shares


def write_tokens(cache: torch.Tensor, fmt: KVPageFormat, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor, chunk_channels: int = CHUNK_CHANNELS, spread: int = SPREAD,
                 append_units: int = APPEND_UNITS, num_warps: int | None = None, dealt: bool | None = None,
                 page_bytes: int | None = None) -> None:
    """Same contract as ``paged_torch.write_tokens``; key/value [N, H, D] (row-strided views allowed).
    ``page_bytes``: the cache's bytes a page, where pages hold more than ``fmt``'s (MiniCache's pair
    pages begin with a layer page's codes).
    Where statistics are per channel: ``chunk_channels`` channels are re-encoded together, and a
    block's chunks are dealt out over ``spread`` programs, or with ``dealt`` over the programs of
    its last new tokens (None: where N * H exceeds DEALT_PROGRAMS), where a decoding token's widened
    storage units are re-encoded ``append_units`` at a time; ``num_warps`` per program (``chunk_channels``
    to ``dealt`` are for benchmarks and tests)."""
    if spread < 1 or spread & (spread - 1):
        raise ValueError(f"spread={spread}: a block's chunks are dealt out over a power of two of programs")
    n = slot_mapping.shape[0]
    if n == 0:
        return
    if dealt is None:
        dealt = n * fmt.k.num_heads > DEALT_PROGRAMS
    if fmt.outliers:
        choose_outliers(cache, fmt, key, value, slot_mapping)
    variant, shares = _write_variant(fmt, chunk_channels, spread, append_units, num_warps, dealt)
    if fmt.v is None:  # K-only pages: nothing reads V's arguments
        value = key
    launch(variant, (n, fmt.k.num_heads, shares),
           (key, value, slot_mapping, cache, n, page_bytes or fmt.page_bytes, key.stride(0), value.stride(0)))


def warm_up(cache: torch.Tensor, fmt: KVPageFormat, dtype: torch.dtype, page_bytes: int | None = None) -> None:
    """Compile both variants a serving step may launch (shares or dealt, by the step's size): vLLM's
    warm-up reaches the small one only where it captures CUDA graphs. One token with no slot (-1):
    nothing is written. ``page_bytes`` as for ``write_tokens``."""
    h, d = fmt.k.num_heads, fmt.k.head_size
    x = torch.zeros(1, h, d, dtype=dtype, device=cache.device)
    nowhere = torch.full((1,), -1, dtype=torch.int64, device=cache.device)
    for dealt in (False, True):
        write_tokens(cache, fmt, x, x, nowhere, dealt=dealt, page_bytes=page_bytes)
