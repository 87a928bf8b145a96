"""Decode attention straight from compressed pages (flash-decoding, GQA-aware).

One program per (request, KV head, split of the context): it reads each page of
its split once for all query heads sharing that KV head, turns codes into
floats in registers, and never writes a full-precision copy of the cache. A
second kernel merges the splits.

The dequantization is folded into the two products: with K per channel,
``q . k_t = sum_d (q_d s_d) c_td + sum_d q_d z_d``, and with V per token,
``sum_t p_t v_t = sum_t (p_t s_t) c_t + (sum_t p_t z_t)``, so only the integer
codes enter the tensor-core dots.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats import KVPageFormat, outliers
from vllm_kvcompress.formats.layout import page_layout
from vllm_kvcompress.formats.merged import MergedLayer
from vllm_kvcompress.formats.salient import NO_SLOT, SalientTokensFormat
from vllm_kvcompress.launch_plans import LaunchPlans
from vllm_kvcompress.token_rows import TokenGroups

from .addressing import code_unit_ptr, unpack_codes
from .launch import Compiled, Variant, device_index, launch, plannable, stream_handle


@triton.jit
def _byte_codes(page, CODES: tl.constexpr, tok, h, ROW: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr,
                GROUP: tl.constexpr, ASM: tl.constexpr):
    """Codes [T, D] of tokens ``tok`` ([T, 1]) of 8-bit rows as float16 (see ``_as_fp16``)
    (``code_unit_ptr`` places them, ``GROUP`` as there)."""
    d = tl.arange(0, D)[None, :]
    c, _, _, _ = _unpacked_planes(tl.load(code_unit_ptr(page, CODES, tok, h, d, ROW, BLOCK, GROUP)), 8, ASM)
    return c


@triton.jit
def _code_planes(page, CODES: tl.constexpr, tok, h, ROW: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr,
                 BITS: tl.constexpr, GROUP: tl.constexpr, ASM: tl.constexpr):
    """Planes k < 8 // bits of tokens ``tok``'s ([T, 1]) 2- or 4-bit codes, or the four planes of
    3-bit codes, as ``_unpacked_planes`` gives them: plane k holds channels ``j * P + k`` as float16
    ``1024 + 2**(k * bits) * code`` (3 bits: ``1024 + 4**k * code``, as 2-bit codes). 3-bit codes
    are two planes (``packing``): byte j of the 2-bit plane holds the low bits of channels 4j..4j+3,
    byte i of the 1-bit plane the high bits of channels 8i..8i+7, that is of 2-bit bytes 2i (its low
    nibble) and 2i + 1 (its high nibble); with ASM the planes are rebuilt by ``_unpack3_asm``."""
    if BITS == 3:
        # [T, D / 8, 2]: 2-bit bytes 2i + s, and the nibble s of 1-bit byte i that holds their high
        # bits. Both loads are contiguous (loading byte j // 2 for each 2-bit byte j was 1.3-1.5x
        # slower; a tl.join of the two nibbles gave wrong K codes on the GPU, docs/formats.md)
        i = tl.arange(0, D // 8)[None, :, None]
        s = tl.arange(0, 2)[None, None, :]
        t3 = tok[:, :, None]
        lo = tl.load(code_unit_ptr(page, CODES, t3, h, 2 * i + s, ROW, BLOCK, GROUP))
        hi = tl.load(code_unit_ptr(page, CODES, t3, h, D // 4 + i, ROW, BLOCK, GROUP)).to(tl.int32) >> (4 * s)
        lo = tl.reshape(lo, (lo.shape[0], D // 4))
        hi = tl.reshape(hi, (lo.shape[0], D // 4))
        if ASM:
            return tl.inline_asm_elementwise(_UNPACK_3, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [lo, hi.to(tl.uint8)],
                                             dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                             is_pure=True, pack=4)
        lo = lo.to(tl.int32)
        return (_as_fp16((lo & 0x03) | ((hi & 1) << 2)), _as_fp16((lo & 0x0C) | ((hi & 2) << 3)),
                _as_fp16((lo & 0x30) | ((hi & 4) << 4)), _as_fp16((lo & 0xC0) | ((hi & 8) << 5)))
    else:
        u = tl.arange(0, D * BITS // 8)[None, :]
        return _unpacked_planes(tl.load(code_unit_ptr(page, CODES, tok, h, u, ROW, BLOCK, GROUP)), BITS, ASM)


@triton.jit
def _as_fp16(codes):
    """Integer codes as float16 ``1024 + code``: the code OR'd into the mantissa of 1024.0 (0x6400),
    with no int-to-float conversion (whose throughput is a quarter of integer logic's). Callers
    subtract 1024 times the other factor's sum."""
    return ((codes.to(tl.int32) | 0x6400).to(tl.int16)).to(tl.float16, bitcast=True)


def _spread(packed: str, lo: str, hi: str) -> str:
    """Two PRMTs that spread bytes 0, 1 and 2, 3 of register ``packed`` into the low bytes of the
    16-bit halves of ``lo`` and ``hi``."""
    return f"prmt.b32 {lo}, {packed}, 0, 0x4140; prmt.b32 {hi}, {packed}, 0, 0x4342;"


def _both_halves(mask: int) -> str:
    """A 16-bit mask in both halves of a 32-bit immediate."""
    return f"0x{mask | mask << 16:08X}"


def _unpack_asm(bits: int) -> str:
    """PTX for ``_unpacked_planes`` on the GPU, four packed bytes ($IN) at a time: ``_spread``, then
    one LOP3 per plane and pair of codes computes ``(halves & field mask) | 0x64006400``: two float16
    values at once. An 8-bit code is a whole byte, so the PRMTs put 0x64 above it directly."""
    if bits == 8:
        return "{ prmt.b32 $0, $2, 0x64646464, 0x4140; prmt.b32 $1, $2, 0x64646464, 0x4342; }"
    planes = 8 // bits
    body = [_spread(f"${2 * planes}", "lo", "hi")]
    for k in range(planes):
        mask = _both_halves(((1 << bits) - 1) << (k * bits))
        body.append(f"lop3.b32 ${2 * k}, lo, {mask}, 0x64006400, 0xEA; "
                    f"lop3.b32 ${2 * k + 1}, hi, {mask}, 0x64006400, 0xEA;")
    return "{ .reg .b32 lo, hi; " + " ".join(body) + " }"


def _unpack3_asm() -> str:
    """PTX for ``_code_planes``' 3-bit codes on the GPU: four bytes of the 2-bit plane ($8) and, byte
    for byte, the nibbles that hold their high bits ($9), each ``_spread``; then per plane k and pair
    of codes a shift brings high bit k to bit 2k + 2, one LOP3 keeps it and ORs in 0x6400, and one
    more ORs in the low bits of the field: ``1024 + 4**k * code`` as float16."""
    body = [_spread("$8", "lo", "hi"), _spread("$9", "hlo", "hhi")]
    for k in range(4):
        field, top = _both_halves(3 << 2 * k), _both_halves(1 << 2 * k + 2)
        for out, low, high in ((2 * k, "lo", "hlo"), (2 * k + 1, "hi", "hhi")):
            body.append(f"shl.b32 t, {high}, {k + 2}; lop3.b32 t, t, {top}, 0x64006400, 0xEA; "
                        f"lop3.b32 ${out}, {low}, {field}, t, 0xEA;")
    return "{ .reg .b32 lo, hi, hlo, hhi, t; " + " ".join(body) + " }"


def _join_asm() -> str:
    """PTX for ``_salient_codes`` on the GPU, four bytes of the high plane ($8) and of the refinement
    ($9) at a time: a shift and a LOP3 (select by mask, 0xE4) give the bytes of 4-bit codes of
    channels 4j, 4j + 2 (``even``) and 4j + 1, 4j + 3 (``odd``), each then unpacked as
    ``_unpack_asm(4)`` unpacks: ``_spread`` and one LOP3 per nibble and pair of codes."""
    body = ["shl.b32 t, $8, 2; lop3.b32 e, t, $9, 0xCCCCCCCC, 0xE4;",
            "shr.b32 t, $9, 2; lop3.b32 o, $8, t, 0xCCCCCCCC, 0xE4;"]
    for word, planes in (("e", (0, 2)), ("o", (1, 3))):
        body.append(_spread(word, "lo", "hi"))
        for nibble, k in enumerate(planes):
            mask = _both_halves(0xF << 4 * nibble)
            body.append(f"lop3.b32 ${2 * k}, lo, {mask}, 0x64006400, 0xEA; "
                        f"lop3.b32 ${2 * k + 1}, hi, {mask}, 0x64006400, 0xEA;")
    return "{ .reg .b32 e, o, t, lo, hi; " + " ".join(body) + " }"


_UNPACK_2 = tl.constexpr(_unpack_asm(2))
_UNPACK_3 = tl.constexpr(_unpack3_asm())
_UNPACK_4 = tl.constexpr(_unpack_asm(4))
_UNPACK_8 = tl.constexpr(_unpack_asm(8))
_JOIN_2_2 = tl.constexpr(_join_asm())
_NO_SLOT = tl.constexpr(NO_SLOT)
# log2(e): the kernels keep maxima and sums in base 2 (exp2), natural log-sum-exps are converted
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _unpacked_planes(packed, BITS: tl.constexpr, ASM: tl.constexpr):
    """Planes k < 8 // BITS of packed bytes (planes past that repeat plane 0), as float16
    ``1024 + 2**(k * BITS) * code``: each field is masked where it lies, not shifted down, so a
    plane costs one AND and one OR per code, and with ASM (PTX, on the GPU) one LOP3 per two codes.
    Callers divide plane k's share by ``2**(k * BITS)``."""
    if ASM:
        if BITS == 8:
            c = tl.inline_asm_elementwise(_UNPACK_8, "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
            return c, c, c, c
        elif BITS == 4:
            c0, c1 = tl.inline_asm_elementwise(_UNPACK_4, "=r,=r,=r,=r,r", [packed],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
            return c0, c1, c0, c0
        else:
            return tl.inline_asm_elementwise(_UNPACK_2, "=r,=r,=r,=r,=r,=r,=r,=r,r", [packed],
                                             dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                             is_pure=True, pack=4)
    elif BITS == 8:
        c = _as_fp16(packed)
        return c, c, c, c
    elif BITS == 4:
        c0 = _as_fp16(packed & 0x0F)
        return c0, _as_fp16(packed & 0xF0), c0, c0
    else:
        return _as_fp16(packed & 0x03), _as_fp16(packed & 0x0C), _as_fp16(packed & 0x30), _as_fp16(packed & 0xC0)


@triton.jit
def _accumulate_plane(acc, alpha, ps, pm, pz, codes, unit, channel_scale):
    """Rescaled running output of a plane plus this tile's share, ``(p*s) . codes + p . zero``
    times the ZipCache channel scale (1.0 without). ``codes`` are ``1024 + code / unit`` (see
    ``_code_planes``: ``unit`` is ``2**-(k*bits)`` for plane k, ``4**-k`` for 3 bits); ``pm`` is 1024
    times the sum of ``p*s``."""
    return acc * alpha + ((tl.dot(ps, codes) - pm) * unit + pz) * channel_scale


@triton.jit
def _salient_codes(page, CODES: tl.constexpr, LOW: tl.constexpr, tok, slot, refined, h, SLOTS: tl.constexpr,
                   ROW: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, ASM: tl.constexpr,
                   INTEGER: tl.constexpr):
    """ZipCache's 4-bit codes of tokens ``tok`` ([T, 1]) in four planes, plane k channels ``4j + k``:
    byte j of the high plane (every token's top 2 bits, ``code_unit_ptr`` places it, ``GROUP`` as
    there) joined with byte j of a refined token's slot row (``[H, SLOTS, ROW]`` at byte LOW; 0 for a
    token not ``refined`` [T]), one product per plane.

    INTEGER: the bytes are joined as integers into two bytes of 4-bit codes, channels 4j, 4j + 2 and
    4j + 1, 4j + 3 (``_join_asm``), unpacked as 4-bit codes are (no second unpacking): float16
    ``1024 + 16**(k // 2) * code``, an unrefined token reading as ``4 * high`` (callers add its 1.5
    steps). Else each plane is unpacked as 2-bit codes and the two joined in float16, three
    operations a code: ``4**k * (4 * high + low)``, not offset by 1024, an unrefined token reading as
    ``4 * high + 1.5`` (exact in float16: at most 960), so that callers add no per-logit term (what
    prompt groups' 64 rows of logits a tile pay for)."""
    u = tl.arange(0, D // 4)[None, :]
    # each branch addresses the slot rows after its high-plane load: an address computed once above
    # both compiles GQA decode rows to 8 spilled bytes (sm_90), a helper function to 16 more instructions
    if not INTEGER:
        h0, h1, h2, h3 = _code_planes(page, CODES, tok, h, ROW, BLOCK, D, 2, GROUP, ASM)
        at = page + LOW + (h * SLOTS + tl.where(refined, slot, 0))[:, None] * ROW + u
        l0, l1, l2, l3 = _unpacked_planes(tl.load(at, mask=refined[:, None], other=0), 2, ASM)
        return (_float16_plane(h0, l0, refined, 1.0), _float16_plane(h1, l1, refined, 4.0),
                _float16_plane(h2, l2, refined, 16.0), _float16_plane(h3, l3, refined, 64.0))
    high = tl.load(code_unit_ptr(page, CODES, tok, h, u, ROW, BLOCK, GROUP))
    at = page + LOW + (h * SLOTS + tl.where(refined, slot, 0))[:, None] * ROW + u
    low = tl.load(at, mask=refined[:, None], other=0)
    if ASM:
        return tl.inline_asm_elementwise(_JOIN_2_2, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [high, low],
                                         dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                         is_pure=True, pack=4)
    high = high.to(tl.int32)
    low = low.to(tl.int32)
    even = ((high << 2) & 0xCC) | (low & 0x33)  # nibbles 4 high + low of channels 4j and 4j + 2
    odd = (high & 0xCC) | ((low >> 2) & 0x33)  # of channels 4j + 1 and 4j + 3
    return _as_fp16(even & 0x0F), _as_fp16(odd & 0x0F), _as_fp16(even & 0xF0), _as_fp16(odd & 0xF0)


@triton.jit
def _float16_plane(high, low, refined, unit):
    """One plane of ``_salient_codes`` joined in float16, from the high plane's and the refinement's
    codes (float16 ``1024 + unit * code``)."""
    middle = tl.where(refined[:, None], 0.0, 1.5 * unit).to(tl.float16)
    return (high - 1024.0) * 4.0 + (low - 1024.0) + middle


@triton.jit
def _rows(pair):
    """The two rows of a [2, N] tensor as [N] tensors."""
    a, b = tl.split(tl.permute(pair, (1, 0)))
    return a, b


@triton.jit
def _split_planes(x, P: tl.constexpr):
    """Channels ``j * P + k`` of x [..., D] as plane k, k < P (planes past P repeat plane 0)."""
    if P == 1:
        return x, x, x, x
    elif P == 2:
        x0, x1 = tl.split(tl.reshape(x, x.shape[:-1] + [x.shape[-1] // 2, 2]))
        return x0, x1, x0, x0
    else:
        even, odd = tl.split(tl.reshape(x, x.shape[:-1] + [x.shape[-1] // 4, 2, 2]))
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        return x0, x1, x2, x3


@triton.jit
def _f32(ptr):
    return tl.load(ptr).to(tl.float32)


@triton.jit
def _softmax_step(s, valid, m, l, GP: tl.constexpr, ONE_ROW: tl.constexpr):
    """Logits ``s`` in base 2 (ONE_ROW: the one query row's, [1, T]) into the running maxima ``m``
    and sums ``l`` [GP]: (the new m and l, the earlier terms' factor [GP, 1], the probabilities)."""
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)[:, None]
    if ONE_ROW:
        p = tl.exp2(s - tl.max(m_new, 0))
    else:
        p = tl.exp2(s - m_new[:, None])
    return m_new, l * tl.reshape(alpha, (GP,)) + tl.sum(p, 1), alpha, p


@triton.jit
def _kept_offsets(page, h, R: tl.constexpr, RP: tl.constexpr, INDEX: tl.constexpr, HEAD_INDEX: tl.constexpr):
    """[RP] int32 offsets in the block of its kept tokens (-1: none): head h's outliers (HEAD_INDEX,
    [H, R] int16) or a MiniCache pair's retained tokens ([R] int16, all heads)."""
    r = tl.arange(0, RP)
    at = (page + INDEX).to(tl.pointer_type(tl.int16)) + r
    if HEAD_INDEX:
        at += h * R
    return tl.load(at, mask=r < R, other=-1).to(tl.int32)


@triton.jit
def _outlier_row(page, j, held, h, stat_row, CODES: tl.constexpr, STATS: tl.constexpr, BITS: tl.constexpr,
                 H: tl.constexpr, D: tl.constexpr):
    """[1, D] float32: head h's outlier ``j`` of K or V (``outliers.quantize_rows``), decoded: codes
    [R, H, D * BITS / 8] at byte CODES, float16 (zero, scale) [R, 2 H, 2] at byte STATS, row
    ``stat_row`` of the 2 H (h for K, H + h for V); zeros unless ``held`` [1]."""
    c = tl.arange(0, D)[None, :]
    per_byte: tl.constexpr = 8 // BITS  # channel c at position c % per_byte of byte c // per_byte
    at = page + CODES + (j * H + h) * (D // per_byte) + c // per_byte
    codes = unpack_codes(tl.load(at).to(tl.int32), c % per_byte, BITS)
    stats = (page + STATS).to(tl.pointer_type(tl.float16)) + (j * 2 * H + stat_row) * 2 + tl.arange(0, 1)
    zero = tl.load(stats).to(tl.float32)
    scale = tl.load(stats + 1).to(tl.float32)
    # the loads wait for nothing: an empty slot's bytes (another request's, or never written) are
    # read and dropped here
    return tl.where(held[:, None], codes * scale[:, None] + zero[:, None], 0.0)


@triton.jit
def _outlier_tokens(page, first, L, seen_from, h, qk, gmask, m, l, acc0, acc1, acc2, acc3, H: tl.constexpr,
                    D: tl.constexpr, GP: tl.constexpr, VP: tl.constexpr, ONE_ROW: tl.constexpr,
                    R: tl.constexpr, INDEX: tl.constexpr, K_CODES: tl.constexpr,
                    V_CODES: tl.constexpr, STATS: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr):
    """One more step of the online softmax (``m``, ``l``, the output's planes) per outlier token of
    the block that starts at token ``first``, for rows that see the keys from ``seen_from`` on (a
    scalar, or [GP, 1] a row) (``formats.outliers``: head h's offsets [H, R] int16 at
    byte INDEX, rows coded on their own grids, ``_outlier_row``). A block keeps one or two: each is one
    row of logits and products in float32, not a tile of the tensor cores padded to 16 tokens.
    ``qk``: the scaled query in float32, [1, D] with ONE_ROW (the one row), else [GP, D]."""
    for j in tl.static_range(R):
        at = tl.load((page + INDEX).to(tl.pointer_type(tl.int16)) + h * R + j + tl.arange(0, 1)).to(tl.int32)
        held = (at >= 0) & (first + at < L)
        k = _outlier_row(page, j, held, h, h, K_CODES, STATS, K_BITS, H, D)
        s = tl.sum(qk * k, 1)[:, None]  # [1 or GP, 1]
        seen = held[None, :] & ((first + at)[None, :] >= seen_from)
        if ONE_ROW:
            m, l, alpha, p1 = _softmax_step(s, seen, m, l, GP, True)
            p = tl.where(gmask, p1, 0.0)
        else:
            m, l, alpha, p = _softmax_step(s, seen, m, l, GP, False)
        v = _outlier_row(page, j, held, h, H + h, V_CODES, STATS, V_BITS, H, D)
        v0, v1, v2, v3 = _split_planes(v, VP)
        acc0 = acc0 * alpha + p * v0
        if VP > 1:
            acc1 = acc1 * alpha + p * v1
        if VP > 2:
            acc2 = acc2 * alpha + p * v2
            acc3 = acc3 * alpha + p * v3
    return m, l, acc0, acc1, acc2, acc3


@triton.jit
def _retained_tokens(page, kept_at, first, L, h, q, q_scale, gmask, m, l, acc0, acc1, acc2, acc3,
                     H: tl.constexpr, D: tl.constexpr, GP: tl.constexpr, VP: tl.constexpr, ONE_ROW: tl.constexpr,
                     ROW_QUERY: tl.constexpr, RP: tl.constexpr, KEPT: tl.constexpr, LAYER: tl.constexpr,
                     LAYERS: tl.constexpr):
    """One more step of the online softmax (``m``, ``l``, the output's planes): a MiniCache pair's
    retained tokens of the block that starts at token ``first`` (their offsets ``kept_at``,
    ``_kept_offsets``), exact, from the block's slots [R, LAYERS, 2 (K, V), H, D] in the model dtype
    (``q``'s), layer LAYER's."""
    dtype = q.dtype
    r = tl.arange(0, RP)
    held = (kept_at >= 0) & (first + kept_at < L)
    d = tl.arange(0, D)[None, :]
    rows = (page + KEPT).to(tl.pointer_type(dtype)) + ((r[:, None] * LAYERS + LAYER) * 2 * H + h) * D + d
    k = tl.load(rows, mask=held[:, None], other=0.0)
    s = tl.dot(tl.broadcast_to(q, (GP, D)), tl.trans(k)) * q_scale
    valid = held[None, :]
    if ONE_ROW:  # one query row: its logits alone (ROW_QUERY: every row is the query's)
        m, l, alpha, p1 = _softmax_step((tl.max(s, 0) if ROW_QUERY else tl.sum(s, 0))[None, :], valid, m, l, GP,
                                        True)
        p = tl.where(gmask, p1, 0.0)
    else:
        m, l, alpha, p = _softmax_step(s, valid, m, l, GP, False)
    v0, v1, v2, v3 = _split_planes(tl.load(rows + H * D, mask=held[:, None], other=0.0), VP)
    p = p.to(dtype)
    acc0 = acc0 * alpha + tl.dot(p, v0)
    if VP > 1:
        acc1 = acc1 * alpha + tl.dot(p, v1)
    if VP > 2:
        acc2 = acc2 * alpha + tl.dot(p, v2)
        acc3 = acc3 * alpha + tl.dot(p, v3)
    return m, l, acc0, acc1, acc2, acc3


# Values that change from step to step, or that ``warm_up`` cannot know, are not specialized on
# (divisibility by 16, equality to 1): each specialization would be compiled in the middle of serving.
@triton.jit(do_not_specialize=["bt_stride", "blocks_per_split", "num_splits", "lse_head_stride"])
def _decode_kernel(
    q_ptr, cache_ptr, half_ptr, block_table_ptr, seq_lens_ptr, group_rows_ptr, group_start_ptr, first_ptr,
    out_ptr, part_ptr, lse_ptr, sm_scale, q_stride, out_stride, bt_stride, page_bytes, page_halves, blocks_per_split, num_splits,
    lse_head_stride,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr, GROUPED: tl.constexpr,
    K_BITS: tl.constexpr, KP: tl.constexpr, K_CODES: tl.constexpr, K_ROW: tl.constexpr, K_SCALE: tl.constexpr,
    K_ZERO: tl.constexpr,
    V_BITS: tl.constexpr, VP: tl.constexpr, V_CODES: tl.constexpr, V_ROW: tl.constexpr, V_SCALE: tl.constexpr,
    V_ZERO: tl.constexpr, V_CS: tl.constexpr, V_GROUP: tl.constexpr, ASM: tl.constexpr, ORDERED: tl.constexpr,
    ONE_ROW: tl.constexpr, ROW_QUERY: tl.constexpr, PRIOR: tl.constexpr, K_NORMS: tl.constexpr,
    V_NORMS: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, INDEX: tl.constexpr, KEPT: tl.constexpr,
    LAYER: tl.constexpr, LAYERS: tl.constexpr, HEAD_INDEX: tl.constexpr, KEPT_V: tl.constexpr,
    KEPT_STATS: tl.constexpr, KEPT_K_BITS: tl.constexpr, KEPT_V_BITS: tl.constexpr,
    WINDOWED: tl.constexpr, SALIENT: tl.constexpr, K_LOW: tl.constexpr, V_LOW: tl.constexpr,
    SLOT_OF: tl.constexpr, SLOTS: tl.constexpr, LSE_OUT: tl.constexpr,
):
    """Program ``(row * H + h, split)`` decodes query row ``row`` (a request's new token, or one token of a
    prefill chunk) for KV head h. GROUPED, program ``(i * H + h, split)`` takes the group starting at
    row ``group_start[i]``: ``group_rows[row]`` rows of the same request from there on (at most GP //
    G), as more rows of the tensor-core products, so a chunk of prompt tokens reads each page once per
    group (the rows share their context length: a chunk's history). ORDERED (one token a program),
    program ``(i * H + h, split)`` takes row ``group_start[i]``: the backend lists rows longest first,
    so that the last programs to start are short ones and the launch ends with fewer SMs idle. Rows are
    ``(token r, query head g)`` pairs, ``m = r * G + g``; each row has its own context length. ONE_ROW
    (MHA, one token a program): the products' other GP - 1 rows have zero queries, so the softmax runs
    on one row of logits, not GP. ROW_QUERY (with ONE_ROW, quantized K): the query is scaled by K's
    channel scales each tile as one [1, D] row, broadcast to the products' rows, instead of as GP rows
    of which GP - 1 are zero. PRIOR: ``out`` already holds each row's attention over other keys (a
    prompt chunk's own tokens), with its natural log-sum-exp at ``lse_ptr`` ([query head, row], heads
    ``lse_head_stride`` apart); the result is the attention over both (split: the merge kernel combines
    them). A row with no context leaves ``out`` as it was.

    KP / VP: planes of K / V (``_planes``: 4 for 2- and 3-bit codes, 2 for 4-bit, 1 otherwise).
    V_GROUP: V's tokens a group (``TensorLayout.token_group``; K's codes are rows per channel).
    Plane k holds channels ``j * P + k``; queries, scales and the output are read and written
    per plane, so packed bytes go to the tensor cores without being interleaved.

    One loop over the split's tiles (a page is BLOCK // TILE tiles). Every load of a tile is wide
    enough (at least 32 bits a thread) for the compiler to pipeline it through shared memory: K's
    scales and zeros of all channels in one [2, D] load, V's of the tile's tokens in one [2, TILE]
    load, next to the codes. Narrower loads (a [D // KP] plane of scales) are not pipelined, and
    every iteration would wait for them.

    K_NORMS / V_NORMS (>= 0: one layer of a MiniCache pair, ``formats.merged.MergedLayer``): byte
    offsets of the layer's per-token K and V norms [H, BLOCK] float16, by which each token's logit
    and probability are scaled (the codes hold unit directions); a negated norm marks a retained
    token, left out of its tile. R > 0: the block's kept tokens (``_retained_tokens``: a pair's
    retained tokens, layer LAYER of its slots at KEPT, their offsets at INDEX; or, HEAD_INDEX, a
    layer page's outlier tokens, ``formats.outliers``, each head's own, left out of their tiles by
    offset) are attended exactly after the split's tiles, a block at a time.

    WINDOWED (a sliding-window layer): row ``i`` sees the keys from ``first_ptr[i]`` on (a grouped
    program's rows each their own); the splits share out the blocks from the program's earliest
    first key on (vLLM has freed the pages before it), each split a whole number of blocks, so
    that each block's kept tokens are taken by one split.

    SALIENT (ZipCache's pages, ``formats.salient``): the codes are the high plane of a 4-bit grid
    (K per channel, V per token); a refined token's low 2 bits come from its slot's row (``slot_of``
    [H, BLOCK] at SLOT_OF, NO_SLOT: none), and an unrefined token reads as the middle of its four
    sub-levels, 1.5 steps above ``4 * high``. The two are joined into 4-bit codes before the
    products, one product per plane (``_salient_codes``): for decode rows as integers (the middle in
    K's logit bias and V's zeros, per token), for prompt groups in float16 (the middle in the codes,
    no term over a tile's 64 rows of logits).

    LSE_OUT (with PRIOR): the merged natural log-sum-exp replaces the prior's at ``lse_ptr`` (the
    ZipCache write turns it into its probes' probabilities).

    ``half_ptr`` is the cache seen as float16 (scales and zeros are read through it, so that the
    compiler knows their alignment and vectorizes the loads).

    The KV heads of one request are neighbours in launch order, so the pages they share (rows of
    all heads lie side by side) are read from memory once and from L2 by the others."""
    h = tl.program_id(0) % H
    if GROUPED or ORDERED:
        row0 = tl.load(group_start_ptr + tl.program_id(0) // H)
    else:
        row0 = tl.program_id(0) // H
    split = tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    TPP: tl.constexpr = BLOCK // TILE
    # plane k's codes come scaled by 2**(k * width), a plane's width being 8 // planes (``_code_planes``;
    # ZipCache's joined in float16 too), ZipCache's joined as integers by 16**(k // 2) (``_salient_codes``)
    K_WIDTH: tl.constexpr = 8 // KP
    V_WIDTH: tl.constexpr = 8 // VP
    # ZipCache's two planes joined as integers for decode rows, in float16 for prompt groups (H200, in
    # one process, us: 144 decode rows MHA 278.9 -> 222.3, GQA 85.2 -> 71.7; 8x512 prompt tokens after
    # 1,536 MHA 853.9 against 951.1 joined as integers, GQA 845.4 against 961.0; docs/log/2026-11-29.md)
    INT_JOIN: tl.constexpr = SALIENT and not GROUPED
    HALF_JOIN: tl.constexpr = SALIENT and not INT_JOIN
    if INT_JOIN:
        V_UNIT1: tl.constexpr = 1.0
        V_UNIT2: tl.constexpr = 1.0 / 16
        V_UNIT3: tl.constexpr = 1.0 / 16
    else:
        V_UNIT1: tl.constexpr = 1.0 / (1 << V_WIDTH)
        V_UNIT2: tl.constexpr = 1.0 / (1 << 2 * V_WIDTH)
        V_UNIT3: tl.constexpr = 1.0 / (1 << 3 * V_WIDTH)

    mi = tl.arange(0, GP)
    r = mi // G
    if not GROUPED:
        rows_used = r < 1
    else:
        rows_used = r < tl.load(group_rows_ptr + row0)
    L = tl.load(seq_lens_ptr + row0)
    if WINDOWED:
        if GROUPED:
            seen_from = tl.load(first_ptr + row0 + r, mask=rows_used, other=L)  # [GP]: each row's first key
            lo = tl.min(seen_from, 0)
            seen_from = seen_from[:, None]
        else:
            seen_from = tl.load(first_ptr + row0)
            lo = seen_from
        lo = tl.maximum(lo, 0)
        t_start = (lo // BLOCK + split * blocks_per_split) * TPP
    else:
        seen_from = 0
        t_start = split * blocks_per_split * TPP
    t_end = tl.minimum(t_start + blocks_per_split * TPP, tl.cdiv(L, TILE))
    if WINDOWED:  # from the first key's tile (the kept tokens' loop below still takes its whole block)
        t_start = tl.maximum(t_start, lo // TILE)

    head = h * G + mi % G
    part_row = (row0 + r) * (H * G) + head  # row of the split partials, [tokens * heads]
    q_row = q_ptr + ((row0 + r) * q_stride + head * D)[:, None]
    gmask = rows_used[:, None]
    DV: tl.constexpr = D // VP
    dv = tl.arange(0, DV)[None, :]
    d = tl.arange(0, D)[None, :]
    # logits in base-2 units: the softmax scale and log2(e) are folded into the query, so that
    # neither costs a multiply per position
    q_scale = sm_scale * _LOG2E
    if ROW_QUERY:  # the one query row alone, [1, D]
        q = tl.load(q_ptr + row0 * q_stride + h * D + d)
    else:
        q = tl.load(q_row + d, mask=gmask, other=0.0)
    qf = q.to(tl.float32) * q_scale
    if INT_JOIN:
        qc = qf / (1 << (4 * ((d % 4) // 2))).to(tl.float32)
    elif KP > 1:
        qc = qf / (1 << (K_WIDTH * (d % KP))).to(tl.float32)
    else:
        qc = qf
    stat = tl.arange(0, 2)[:, None]  # row 0: scale, row 1: zero

    if R > 0 or WINDOWED:  # a tile may hold no key a row sees: from a finite floor, no step gives exp2(nan)
        m = tl.full([GP], -1.0e30, tl.float32)
    else:
        m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc0 = tl.zeros([GP, DV], tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for t in range(t_start, t_end):
        block_id = tl.load(block_table_ptr + row0 * bt_stride + t // TPP).to(tl.int64)
        page = cache_ptr + block_id * page_bytes
        half = half_ptr + block_id * page_halves
        tok = (t % TPP) * TILE + tl.arange(0, TILE)
        pos = ((t // TPP) * BLOCK + tok)[None, :]
        valid = pos < L
        if WINDOWED:
            valid = valid & (pos >= seen_from)
        if K_NORMS >= 0:
            nk = tl.load(half + K_NORMS // 2 + h * BLOCK + tok)
            valid = valid & (nk.to(tl.int16, bitcast=True) >= 0)[None, :]
            nk = nk.to(tl.float32)[None, :]
        if R > 0:
            kept = _kept_offsets(page, h, R, RP, INDEX, HEAD_INDEX)
        if HEAD_INDEX:  # the block's outlier tokens are read from their slots, not from the codes
            valid = valid & (tl.sum((tok[None, :] == kept[:, None]).to(tl.int32), 0) == 0)[None, :]
        if K_BITS == 16:
            k_row = page + K_CODES + (tok[:, None] * H + h) * K_ROW
            s = tl.dot(q, tl.trans(tl.load(k_row.to(tl.pointer_type(dtype)) + d))) * q_scale
        else:
            # scale and zero of every channel in one contiguous load, wide enough to be pipelined
            kstat = tl.load(half + h * D + K_SCALE // 2 + stat * ((K_ZERO - K_SCALE) // 2) + d).to(tl.float32)
            ks, kz = _rows(kstat)
            qs = (qc * ks[None, :]).to(tl.float16)
            if HALF_JOIN:
                bias = tl.sum(qf * kz[None, :], 1)
            else:
                bias = tl.sum(qf * kz[None, :], 1) - 1024.0 * tl.sum(qs.to(tl.float32), 1)
            if KP == 1:  # 8 bits
                s = tl.dot(qs, tl.trans(_byte_codes(page, K_CODES, tok[:, None], h, K_ROW, BLOCK, D, 0, ASM)))
            else:
                if SALIENT:
                    slot = tl.load(page + SLOT_OF + h * BLOCK + tok).to(tl.int32)
                    refined = slot != _NO_SLOT
                    k0, k1, k2, k3 = _salient_codes(page, K_CODES, K_LOW, tok[:, None], slot, refined, h, SLOTS,
                                                    K_ROW, BLOCK, D, 0, ASM, INT_JOIN)
                else:
                    k0, k1, k2, k3 = _code_planes(page, K_CODES, tok[:, None], h, K_ROW, BLOCK, D, K_BITS, 0, ASM)
                qs0, qs1, qs2, qs3 = _split_planes(qs, KP)
                if ROW_QUERY:  # every row of the products is the query's
                    qs0 = tl.broadcast_to(qs0, (GP, D // KP))
                    qs1 = tl.broadcast_to(qs1, (GP, D // KP))
                    qs2 = tl.broadcast_to(qs2, (GP, D // KP))
                    qs3 = tl.broadcast_to(qs3, (GP, D // KP))
                s = tl.dot(qs0, tl.trans(k0))
                s += tl.dot(qs1, tl.trans(k1))
                if KP > 2:
                    s += tl.dot(qs2, tl.trans(k2))
                    s += tl.dot(qs3, tl.trans(k3))
            if INT_JOIN:  # a token not refined reads 1.5 steps above its code, 4 * high, every channel
                bias = bias[:, None] + tl.where(refined[None, :], 0.0, 1.5 * tl.sum(qf * ks[None, :], 1)[:, None])
            else:
                bias = bias[:, None]
            if ROW_QUERY:  # every row is the query's logits: any one of them
                s1 = tl.max(s, 0)[None, :] + bias
            else:
                s += bias
        if K_NORMS >= 0:
            if ROW_QUERY:
                s1 = s1 * nk
            else:
                s = s * nk
        if ONE_ROW:
            # one query row (MHA): the softmax runs on the tile's one row of logits instead of GP
            # rows; without ROW_QUERY, the products' other rows have zero queries and are zero
            if not ROW_QUERY:
                s1 = tl.sum(s, 0)[None, :]
            m, l, alpha, p1 = _softmax_step(s1, valid, m, l, GP, True)
        else:
            m, l, alpha, p = _softmax_step(s, valid, m, l, GP, False)
        if V_NORMS >= 0:  # past the context, a page's norms may be anything: zero probability stays zero
            nv = tl.where(valid, tl.load(half + V_NORMS // 2 + h * BLOCK + tok).to(tl.float32)[None, :], 0.0)
        if V_BITS == 16:
            v_row = page + V_CODES + (tok[:, None] * H + h) * V_ROW
            if ONE_ROW:
                p = tl.where(gmask, p1, 0.0)
            if V_NORMS >= 0:
                p = p * nv
            acc0 = acc0 * alpha + tl.dot(p.to(dtype), tl.load(v_row.to(tl.pointer_type(dtype)) + d))
        else:
            vstat = tl.load(half + h * BLOCK + V_SCALE // 2 + stat * ((V_ZERO - V_SCALE) // 2) + tok[None, :])
            vs, vz = _rows(vstat.to(tl.float32))
            if INT_JOIN:  # a token not refined reads 1.5 steps above its code: in its zero
                vz += tl.where(refined, 0.0, 1.5 * vs)
            if V_NORMS >= 0:
                vs = vs * tl.reshape(nv, (TILE,))
                vz = vz * tl.reshape(nv, (TILE,))
            if ONE_ROW:
                ps1 = (p1 * vs[None, :]).to(tl.float16)
                if ROW_QUERY:
                    ps = tl.broadcast_to(ps1, (GP, TILE))  # rows past the first are written nowhere
                else:
                    ps = tl.where(gmask, ps1, 0.0).to(tl.float16)
                pz = tl.sum(p1 * vz[None, :], 1)
                pm = 1024.0 * tl.sum(ps1.to(tl.float32), 1)
            else:
                ps = (p * vs[None, :]).to(tl.float16)
                pz = tl.sum(p * vz[None, :], 1)[:, None]
                pm = 0.0 if HALF_JOIN else 1024.0 * tl.sum(ps.to(tl.float32), 1)[:, None]  # codes: 1024 + code
            if V_CS >= 0:  # ZipCache channel scales
                c0, c1, c2, c3 = _split_planes(_f32(half + V_CS // 2 + h * D + d), VP)
            else:
                c0, c1, c2, c3 = 1.0, 1.0, 1.0, 1.0
            if VP == 1:  # 8 bits
                codes = _byte_codes(page, V_CODES, tok[:, None], h, V_ROW, BLOCK, D, V_GROUP, ASM)
                acc0 = _accumulate_plane(acc0, alpha, ps, pm, pz, codes, 1.0, c0)
            else:
                # codes byte-major (statistics per token): a byte's tokens lie together, the order of
                # the product over tokens
                if SALIENT:
                    v0, v1, v2, v3 = _salient_codes(page, V_CODES, V_LOW, tok[:, None], slot, refined, h, SLOTS,
                                                    V_ROW, BLOCK, D, V_GROUP, ASM, INT_JOIN)
                else:
                    v0, v1, v2, v3 = _code_planes(page, V_CODES, tok[:, None], h, V_ROW, BLOCK, D, V_BITS, V_GROUP,
                                                  ASM)
                acc0 = _accumulate_plane(acc0, alpha, ps, pm, pz, v0, 1.0, c0)
                acc1 = _accumulate_plane(acc1, alpha, ps, pm, pz, v1, V_UNIT1, c1)
                if VP > 2:
                    acc2 = _accumulate_plane(acc2, alpha, ps, pm, pz, v2, V_UNIT2, c2)
                    acc3 = _accumulate_plane(acc3, alpha, ps, pm, pz, v3, V_UNIT3, c3)
    if R > 0:  # the kept tokens of the split's blocks, in a loop of their own (the tiles' stays lean)
        if ONE_ROW and not ROW_QUERY:  # the products' other rows are zero: the query row alone
            qk = tl.sum(qf, 0)[None, :]
        else:
            qk = qf
        for b in range(t_start // TPP, tl.cdiv(t_end, TPP)):
            page = cache_ptr + tl.load(block_table_ptr + row0 * bt_stride + b).to(tl.int64) * page_bytes
            if HEAD_INDEX:
                m, l, acc0, acc1, acc2, acc3 = _outlier_tokens(
                    page, b * BLOCK, L, seen_from, h, qk, gmask, m, l, acc0, acc1, acc2, acc3, H, D, GP,
                    VP, ONE_ROW, R, INDEX, KEPT, KEPT_V, KEPT_STATS, KEPT_K_BITS, KEPT_V_BITS)
            else:
                m, l, acc0, acc1, acc2, acc3 = _retained_tokens(
                    page, _kept_offsets(page, h, R, RP, INDEX, HEAD_INDEX), b * BLOCK, L, h, q, q_scale, gmask, m,
                    l, acc0, acc1, acc2, acc3, H, D, GP, VP, ONE_ROW, ROW_QUERY, RP, KEPT, LAYER, LAYERS)

    if not SPLIT:
        dst = out_ptr + ((row0 + r) * out_stride + head * D)[:, None] + dv * VP
        if PRIOR:  # both parts' sums, each relative to the larger of their maxima (base 2)
            prior = tl.load(lse_ptr + head * lse_head_stride + row0 + r, mask=rows_used, other=0.0) * _LOG2E
            top = tl.maximum(m, prior)
            alpha = tl.exp2(m - top)[:, None]
            beta = tl.exp2(prior - top)[:, None]
            l = l * tl.reshape(alpha, (GP,)) + tl.reshape(beta, (GP,))
            acc0 = acc0 * alpha + tl.load(dst, mask=gmask, other=0.0).to(tl.float32) * beta
            if VP > 1:
                acc1 = acc1 * alpha + tl.load(dst + 1, mask=gmask, other=0.0).to(tl.float32) * beta
            if VP > 2:
                acc2 = acc2 * alpha + tl.load(dst + 2, mask=gmask, other=0.0).to(tl.float32) * beta
                acc3 = acc3 * alpha + tl.load(dst + 3, mask=gmask, other=0.0).to(tl.float32) * beta
            if LSE_OUT:
                tl.store(lse_ptr + head * lse_head_stride + row0 + r, (top + tl.log2(l)) / _LOG2E, mask=rows_used)
        tl.store(dst, (acc0 / l[:, None]).to(dtype), mask=gmask)
        if VP > 1:
            tl.store(dst + 1, (acc1 / l[:, None]).to(dtype), mask=gmask)
        if VP > 2:
            tl.store(dst + 2, (acc2 / l[:, None]).to(dtype), mask=gmask)
            tl.store(dst + 3, (acc3 / l[:, None]).to(dtype), mask=gmask)
    else:
        base = part_ptr + (part_row[:, None] * num_splits + split) * (D + 2)
        tl.store(base + dv * VP, acc0, mask=gmask)
        if VP > 1:
            tl.store(base + dv * VP + 1, acc1, mask=gmask)
        if VP > 2:
            tl.store(base + dv * VP + 2, acc2, mask=gmask)
            tl.store(base + dv * VP + 3, acc3, mask=gmask)
        tl.store(base + D + tl.zeros([GP, 1], tl.int32), m[:, None], mask=gmask)
        tl.store(base + D + 1 + tl.zeros([GP, 1], tl.int32), l[:, None], mask=gmask)


MAX_SPLITS = 64
# programs a SM that the split count aims for, at every code width (docs/benchmarks.md: 8-bit codes
# asked for 4 until their programs ran 3 stages)
PROGRAMS_PER_SM = 2


@triton.jit(do_not_specialize=["num_splits", "lse_head_stride"])
def _merge_splits_kernel(part_ptr, seq_lens_ptr, out_ptr, lse_ptr, out_stride, num_splits, lse_head_stride,
                         HQ: tl.constexpr, D: tl.constexpr, MAX_SPLITS: tl.constexpr, PRIOR: tl.constexpr,
                         LSE_OUT: tl.constexpr):
    """Row ``program_id(0)``'s output for query head ``program_id(1)`` from its splits' partials
    (PRIOR: and the attention ``out`` holds, as in the decode kernel). A row of context 0 is left
    as it is: no program wrote its partials (a CUDA graph's padding, a prompt chunk with no
    history). LSE_OUT (with PRIOR): the merged log-sum-exp replaces the prior's."""
    row = tl.program_id(0) * HQ + tl.program_id(1)
    s = tl.arange(0, MAX_SPLITS)
    d = tl.arange(0, D)
    used = s < num_splits
    base = part_ptr + (row * num_splits + s) * (D + 2)
    m = tl.load(base + D, mask=used, other=float("-inf"))
    l = tl.load(base + D + 1, mask=used, other=0.0)
    acc = tl.load(base[:, None] + d[None, :], mask=used[:, None], other=0.0)
    dst = out_ptr + tl.program_id(0) * out_stride + tl.program_id(1) * D + d
    context = tl.load(seq_lens_ptr + tl.program_id(0))
    written = d * 0 + context > 0
    top = tl.max(m, 0)  # maxima in base-2 units
    if PRIOR:
        prior = tl.load(lse_ptr + tl.program_id(1) * lse_head_stride + tl.program_id(0)) * _LOG2E
        top = tl.maximum(top, prior)
    w = tl.exp2(m - top)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    if PRIOR:
        beta = tl.exp2(prior - top)
        num += tl.load(dst, mask=written, other=0.0).to(tl.float32) * beta
        den += beta
        if LSE_OUT:
            one = tl.arange(0, 1)
            tl.store(lse_ptr + tl.program_id(1) * lse_head_stride + tl.program_id(0) + one,
                     (top + tl.log2(den)) / _LOG2E + 0.0 * one, mask=one * 0 + context > 0)
    tl.store(dst, (num / den).to(out_ptr.dtype.element_ty), mask=written)


def _planes(bits: int) -> int:
    """Byte planes a tensor's codes are read as (``_code_planes``; 3-bit codes as 2-bit ones)."""
    return {2: 4, 3: 4, 4: 2}.get(bits, 1)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, split_tokens: int,
                      device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Enough programs to give each SM ``programs_per_sm``, a power of two, and no more than the
    context's pieces of ``split_tokens`` (a page, for the Triton kernel) rounded up to one."""
    if device.type != "cuda":
        return 1
    want = max(1, -(-programs_per_sm * _multiprocessors(device_index(device)) // (num_seqs * num_kv_heads)))
    pieces = max(1, -(-max_seq_len // split_tokens))
    return min(triton.next_power_of_2(want), triton.next_power_of_2(pieces), MAX_SPLITS)


# Rows of the tensor-core products in a program that takes a group of prompt tokens: each page
# tile a group reads is decoded once for all of them (docs/benchmarks.md: prompt rows)
PROMPT_ROWS = 64


def _padded_rows(group: int, tokens: int) -> int:
    """Rows of the kernel's tensor-core products for ``tokens`` query tokens of ``group`` query heads
    per KV head: at least 16."""
    return max(16, triton.next_power_of_2(group * tokens))


def rows_per_program(group: int, prompt_rows: int = PROMPT_ROWS) -> int:
    """Query tokens of one request that a program can take at once, with ``group`` query heads per
    KV head: as many as fill ``prompt_rows`` rows (64 tokens for MHA)."""
    return max(1, max(prompt_rows, triton.next_power_of_2(group)) // group)


def kernel_constants(fmt: KVPageFormat | MergedLayer | SalientTokensFormat, group: int, split: bool, tile: int,
                     group_size: int | None, asm_unpack: bool, ordered: bool, prior: bool = False,
                     windowed: bool = False, lse_out: bool = False) -> dict:
    """The decode kernel's compile-time constants for a page format, query heads per KV head,
    whether the context is split over programs, the tokens a program takes together (None: one
    token a program, ungrouped), whether codes are unpacked with PTX (on an NVIDIA GPU;
    Triton's interpreter runs no PTX), whether ungrouped rows come in a given order, whether
    the output continues a prior attention (``paged_decode``'s ``prior_lse``), whether rows
    see a sliding window (``paged_decode``'s ``first_keys``), and whether the merged log-sum-exp
    replaces the prior's (``lse_out``)."""
    lay = page_layout(fmt)
    one_row = group == 1 and group_size is None
    return dict(
        H=lay.num_kv_heads, G=group, GP=_padded_rows(group, group_size or 1), D=lay.head_size,
        BLOCK=lay.block_size, TILE=tile, SPLIT=split, GROUPED=group_size is not None,
        K_BITS=lay.k.bits, KP=_planes(lay.k.bits), K_CODES=lay.k.codes, K_ROW=lay.k.row_bytes,
        K_SCALE=lay.k.scale, K_ZERO=lay.k.zero,
        V_BITS=lay.v.bits, VP=_planes(lay.v.bits), V_CODES=lay.v.codes, V_ROW=lay.v.row_bytes,
        V_SCALE=lay.v.scale, V_ZERO=lay.v.zero, V_CS=lay.v.channel_scale, V_GROUP=lay.v.token_group,
        ASM=asm_unpack, ORDERED=ordered,
        ONE_ROW=one_row,
        # 2- and 3-bit K (four planes): scaling four planes of one row saves most (H200, MHA 2/2,
        # batch 64 at 4,096 tokens 382.8 -> 369.4 us, a serving step's rows 122.4 -> 113.6; 3/2 with
        # an outlier a block, serving 269.7 -> 249.6); at 4 and 8 bits the compiled loop came out no
        # faster (4/4 402.0 against 399.1, serving 131.2 against 128.1)
        ROW_QUERY=one_row and lay.k.bits in (2, 3),
        PRIOR=prior,
        WINDOWED=windowed,
        LSE_OUT=lse_out,
        **_kept_constants(fmt),
        **salient_constants(fmt),
    )


def salient_constants(fmt: KVPageFormat | MergedLayer | SalientTokensFormat) -> dict:
    """Where ZipCache's pages keep the refinement rows and the slot map (none: SALIENT False)."""
    if not isinstance(fmt, SalientTokensFormat):
        return dict(SALIENT=False, K_LOW=0, V_LOW=0, SLOT_OF=0, SLOTS=1)
    at = fmt.regions.start
    return dict(SALIENT=True, K_LOW=at("k_low"), V_LOW=at("v_low"), SLOT_OF=at("slot_of"), SLOTS=fmt.slots)


def _kept_constants(fmt: KVPageFormat | MergedLayer) -> dict:
    """Where a page keeps tokens exact: a MiniCache pair's layer its norms and retained tokens, a
    layer page its outlier tokens (none: R 0)."""
    none = dict(K_NORMS=-1, V_NORMS=-1, R=0, RP=16, INDEX=0, KEPT=0, LAYER=0, LAYERS=1, HEAD_INDEX=False, KEPT_V=0,
                KEPT_STATS=0, KEPT_K_BITS=16, KEPT_V_BITS=16)
    if isinstance(fmt, SalientTokensFormat):
        return none
    if isinstance(fmt, MergedLayer):
        at = fmt.pair.regions.start
        return none | dict(K_NORMS=fmt.norms_at(0), V_NORMS=fmt.norms_at(1), R=fmt.pair.retained,
                           RP=max(16, triton.next_power_of_2(fmt.pair.retained)), INDEX=at("index"), KEPT=at("kept"),
                           LAYER=fmt.layer, LAYERS=2)
    if fmt.outliers:
        return none | dict(R=fmt.outliers, RP=max(16, triton.next_power_of_2(fmt.outliers)),
                           INDEX=fmt.outlier_at("index"), KEPT=fmt.outlier_at("k_codes"), HEAD_INDEX=True,
                           KEPT_V=fmt.outlier_at("v_codes"), KEPT_STATS=fmt.outlier_at("stats"),
                           KEPT_K_BITS=outliers.K_BITS, KEPT_V_BITS=outliers.V_BITS)
    return none


@functools.cache
def default_tuning(fmt: KVPageFormat, grouped: bool, group: int) -> dict:
    """Tokens per tile, pipeline stages and warps, for programs of one query token or of a group of
    them (``grouped``), ``group`` query heads a KV head. Pages are read through an indirection (the
    block table), so the compiler prefetches a tile (num_stages - 1) // 2 tiles ahead: 5 stages keep the next tile's loads in
    flight while this one is computed. One token's programs run 2 warps
    (4/4, batch 64 at 4,096 tokens: 409 us instead of 501 with 4 warps for MHA, 112 instead of 149
    for GQA; GQA 8/8 172 us instead of 184, a serving step's rows 54.8 us either way;
    docs/benchmarks.md). Groups of prompt tokens (PROMPT_ROWS rows) take 4. A token's programs over
    8-bit codes run 3 stages: their tiles (32 KB of codes) keep enough bytes in flight with fewer
    buffers, which leaves room for more programs a SM (H200, batch 64 at 4,096 tokens: GQA 8/8
    145.5 us in one split against 165.2 with 5 stages in two, MHA 523.0 against 527.1; a serving
    step's rows 163.3 against 168.5 MHA, 53.2 against 55.0 GQA; docs/benchmarks.md). So do 3-bit
    codes, whose unpacking holds more registers (H100, a serving step's rows: quant-k3v2-o1 MHA
    258.4 us against 300.0 with 5 stages, 406.1 with 4 warps; GQA 82.4 against 88.3; quant-k3v3 MHA
    276.5 against 283.6). ZipCache's one-row (MHA) programs run 4 warps (H200, 144 rows: 214.7 us
    against 222.3, and 211.9 against 219.7 in another call; GQA's 81.3 against 71.7 with 2). The
    split count is ``choose_num_splits``'s."""
    lay = page_layout(fmt)
    tile, stages, warps = (128 if lay.head_size <= 128 else 32), 5, (4 if grouped else 2)
    if isinstance(fmt, SalientTokensFormat) and group == 1:
        warps = 4
    if {8, 3} & {lay.k.bits, lay.v.bits} and not grouped:
        stages = 3
    return {"tile": min(lay.block_size, tile), "num_stages": stages, "num_warps": warps}


@functools.cache
def _variant(fmt: KVPageFormat, group: int, split: bool, group_size: int | None, asm_unpack: bool,
             tile: int | None, num_warps: int | None, num_stages: int | None, ordered: bool, prior: bool,
             windowed: bool, lse_out: bool) -> Variant:
    """The decode kernel's variant: constants, and the default tuning where ``tile``, ``num_warps``
    or ``num_stages`` is None."""
    tuning = default_tuning(fmt, group_size is not None, group)
    return Variant(_decode_kernel,
                   kernel_constants(fmt, group, split, tile or tuning["tile"], group_size, asm_unpack, ordered,
                                    prior, windowed, lse_out),
                   {"num_warps": num_warps or tuning["num_warps"], "num_stages": num_stages or tuning["num_stages"]})


@functools.cache
def _merge_variant(num_query_heads: int, head_size: int, prior: bool, lse_out: bool) -> Variant:
    return Variant(_merge_splits_kernel, {"HQ": num_query_heads, "D": head_size, "MAX_SPLITS": MAX_SPLITS,
                                          "PRIOR": prior, "LSE_OUT": lse_out}, {})


def _row_strided(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` [N, H, D] with its token-row stride, copied only where heads or channels are not
    contiguous within a row (a query arrives as a view into the fused QKV output)."""
    _, heads, d = x.stride()
    if d != 1 or heads != x.shape[2]:
        x = x.contiguous()
    return x, x.stride(0)


class SplitLaunch(NamedTuple):
    """What a decode launch over a context split ``num_splits`` ways writes to and reads from."""
    query: torch.Tensor   # row-strided (heads and channels contiguous within a row)
    q_stride: int
    out: torch.Tensor
    num_splits: int
    max_blocks: int       # pages of the longest context (at least 1): the block-table entries a row may be read at
    blocks_per_split: int
    part: torch.Tensor    # ``out``, or float32 partials [N, Hq, splits, D + 2] (``merge_splits``)


def query_and_output(query: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, int, torch.Tensor]:
    """A decode launch's query, row-strided (``_row_strided``), its row stride, and its output:
    ``out``, whose heads and channels must be contiguous within a row, or a new tensor."""
    query, q_stride = _row_strided(query)
    if out is None:
        out = torch.empty_like(query)
    elif out.stride(2) != 1 or out.stride(1) != query.shape[2]:
        raise ValueError(f"out: strides {out.stride()}; heads and channels must be contiguous within a row")
    return query, q_stride, out


def split_launch(query: torch.Tensor, out: torch.Tensor, fmt: KVPageFormat, max_seq_len: int,
                 num_splits: int | None, programs_per_sm: int = PROGRAMS_PER_SM) -> SplitLaunch:
    """A decode launch's buffers and split count (``choose_num_splits``'s where None), for a query
    and output as ``query_and_output`` gives them."""
    n, hq, d = query.shape
    if num_splits is None:
        num_splits = choose_num_splits(n, fmt.k.num_heads, max_seq_len, fmt.block_size, query.device,
                                       programs_per_sm)
    max_blocks = max(1, -(-max_seq_len // fmt.block_size))
    blocks_per_split = -(-max_blocks // num_splits)
    part = out
    if num_splits > 1:
        per_program = programs_per_sm * (hq // fmt.k.num_heads) * (d + 2)
        part = _partials(n * hq * num_splits * (d + 2), query.device, per_program).view(n, hq, num_splits, d + 2)
    return SplitLaunch(query, query.stride(0), out, num_splits, max_blocks, blocks_per_split, part)


_partials_buffers: dict[tuple, list[torch.Tensor]] = {}  # by device and stream, the largest last


def _partials(numel: int, device: torch.device, per_program: int) -> torch.Tensor:
    """Float32 room for a split launch's partials (``per_program`` floats a program of a KV head), at
    the start of a buffer kept for the device's current stream and shared by every launch on it: a
    launch's merge has read them before the next launch on the stream writes them. A step's layers
    then allocate nothing (two tensors a layer cost the host microseconds outside CUDA graphs), and
    the buffer stays where CUDA graphs captured it. It is made large enough for any split count that
    ``choose_num_splits`` gives, under 4 x its programs (the power of two past a count that fills
    the SMs); one made too small for a count asked for explicitly is kept when a larger one is made."""
    cuda = device.type == "cuda"
    key = (device.type, device.index, stream_handle(device) if cuda else 0)
    buffers = _partials_buffers.setdefault(key, [])
    if not buffers or buffers[-1].numel() < numel:
        least = 4 * _multiprocessors(device_index(device)) * per_program if cuda else 0
        buffers.append(torch.empty(max(numel, least), dtype=torch.float32, device=device))
    return buffers[-1][:numel]


def merge_splits(run: SplitLaunch, seq_lens: torch.Tensor, prior_lse: torch.Tensor | None = None,
                 lse_out: bool = False) -> Compiled | None:
    """The output from a split launch's partials (nothing to do with one split) for the rows of
    nonzero ``seq_lens``, combined with the attention ``out`` holds where ``prior_lse`` is given
    (``paged_decode``, as its ``lse_out``); the compiled merge kernel, as ``launch`` returns it."""
    if run.num_splits > 1:
        n, hq, d = run.query.shape
        lse = seq_lens if prior_lse is None else prior_lse
        return launch(_merge_variant(hq, d, prior_lse is not None, lse_out), (n, hq),
                      (run.part, seq_lens, run.out, lse, run.out.stride(0), run.num_splits, lse.stride(0)))
    return None


class _DecodePlan(NamedTuple):
    """A decode launch and its merge, compiled (``launch.Compiled``), with every argument but a
    layer's query, cache and output kept as plain values: what a step's other layers launch."""
    decode: Compiled
    grid: tuple[int, int, int]
    tables: tuple        # block table, context lengths, group rows, group starts, first keys: pointers
    part: int | None     # the partials' pointer; None: one split, the output takes them
    scalars: tuple       # the decode kernel's scalar arguments after the pointers
    merge: Compiled | None
    merge_grid: tuple[int, int, int]
    merge_scalars: tuple  # the output's row stride, the split count, the prior's head stride

    def __call__(self, stream: int, query: int, cache: int, out: int, lse: int) -> None:
        self.decode.run(self.grid, stream, (query, cache, cache, *self.tables, out,
                                            out if self.part is None else self.part, lse, *self.scalars))
        if self.merge is not None:
            self.merge.run(self.merge_grid, stream, (self.part, self.tables[1], out, lse, *self.merge_scalars))


_plans = LaunchPlans()  # by step: rows, lengths, format and the pointers' alignments


def paged_decode(query: torch.Tensor, cache: torch.Tensor, fmt: KVPageFormat | MergedLayer,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, max_seq_len: int,
                 num_splits: int | None = None, out: torch.Tensor | None = None, tile: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 programs_per_sm: int = PROGRAMS_PER_SM,
                 groups: TokenGroups | None = None, row_order: torch.Tensor | None = None,
                 prior_lse: torch.Tensor | None = None, lse_out: bool = False,
                 window: int | None = None, first_keys: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per row (``query`` [N, Hq, D]) over its request's pages.

    ``cache`` is the layer's pages as ``[num_blocks, page_bytes]`` uint8 (or a MiniCache pair's, read
    for one of its layers: ``MergedLayer``);
    ``block_table`` [N, max_blocks] and ``seq_lens`` [N] (context length,
    the new token included) are int32 on the same device. ``groups`` (from ``token_rows`` with
    ``rows_per_program``): rows that one program takes together, of one context length. ``query``
    and ``out`` may be row-strided views (heads and channels contiguous within a row).
    ``prior_lse`` [Hq, N] (float32, rows contiguous): ``out`` already holds each row's attention
    over other keys, with this natural log-sum-exp, and ends up holding the attention over both
    (rows of context 0 keep it as it is); with ``lse_out``, ``prior_lse`` ends up holding the
    log-sum-exp of both. ``window`` and ``first_keys`` [N] int32 (a
    sliding-window layer's, both or neither): row i sees the keys from ``first_keys[i]`` on (which
    may be below 0), and the splits share out the blocks from there.

    On CUDA, the launch is planned (``_DecodePlan``): a later call with the same arguments but its
    query, cache and output (a step's next layer) launches the compiled kernels directly.
    """
    if groups is not None and row_order is not None:
        raise ValueError("row_order: grouped rows are taken in their groups' order")
    query, q_stride, out = query_and_output(query, out)
    if prior_lse is not None and prior_lse.stride(1) != 1:
        raise ValueError(f"prior_lse: strides {prior_lse.stride()}; a head's rows must be contiguous")
    if lse_out and prior_lse is None:
        raise ValueError("lse_out: the merged log-sum-exp replaces a prior_lse")
    lse = seq_lens if prior_lse is None else prior_lse  # a pointer the kernel never reads without a prior
    if (window is None) != (first_keys is None):
        raise ValueError("window and first_keys: both for a sliding-window layer, or neither")
    first = seq_lens if first_keys is None else first_keys  # likewise without
    key = None
    if plannable(query.device):
        pointers = query.data_ptr(), cache.data_ptr(), out.data_ptr(), lse.data_ptr()
        stream = stream_handle(query.device)
        key = (fmt, query.shape, query.dtype, q_stride, out.dtype, out.stride(0), block_table.data_ptr(),
               block_table.stride(0), seq_lens.data_ptr(), None if groups is None else groups.rows.data_ptr(),
               None if groups is None else groups.starts.data_ptr(), None if groups is None else groups.size,
               first.data_ptr(), window,
               None if groups is None else groups.starts.shape[0], None if row_order is None else row_order.data_ptr(),
               None if prior_lse is None else prior_lse.stride(0), lse_out, sm_scale, max_seq_len, num_splits, tile,
               num_warps, num_stages, programs_per_sm, stream,
               tuple([p & 15 == 0 for p in pointers]))  # the compiled kernel's specialization
        plan = _plans.find(key)
        if plan is not None:
            plan(stream, *pointers)
            return out
    if window is not None:  # the blocks a row's keys span, from its first key's block on
        rows = 1 if groups is None else groups.size
        max_seq_len = min(max_seq_len, (-(-(window + rows - 1) // fmt.block_size) + 1) * fmt.block_size)
    run = split_launch(query, out, fmt, max_seq_len, num_splits, programs_per_sm)
    n, hq, _ = run.query.shape
    h = fmt.k.num_heads
    programs = n if groups is None else groups.starts.shape[0]
    variant = _variant(fmt, hq // h, run.num_splits > 1, None if groups is None else groups.size,
                       query.is_cuda and torch.version.hip is None, tile, num_warps, num_stages,
                       row_order is not None, prior_lse is not None, window is not None, lse_out)
    starts = groups.starts if groups is not None else row_order if row_order is not None else seq_lens
    tables = (block_table, seq_lens, seq_lens if groups is None else groups.rows, starts, first)
    scalars = (sm_scale, run.q_stride, run.out.stride(0), block_table.stride(0), fmt.page_bytes, fmt.page_bytes // 2,
               run.blocks_per_split, run.num_splits, lse.stride(0))
    grid = (programs * h, run.num_splits, 1)
    decode = launch(variant, grid, (run.query, cache, cache.view(torch.float16), *tables, run.out, run.part, lse,
                                    *scalars))
    merge = merge_splits(run, seq_lens, prior_lse, lse_out)
    if key is not None and decode is not None and (merge is not None or run.num_splits == 1):
        _plans.keep(key, _DecodePlan(decode, grid, tuple([t.data_ptr() for t in tables]),
                                     None if run.num_splits == 1 else run.part.data_ptr(), scalars, merge, (n, hq, 1),
                                     (run.out.stride(0), run.num_splits, lse.stride(0))))
    return run.out


def longest_first(seq_lens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows in decreasing context length, int32 (``paged_decode``'s ``row_order``), into ``out`` where
    given. On an H200, a serving step's decode rows (144 requests, contexts 16..900, 4/4) took 131.7
    us in this order against 143.7 as drawn (GQA 42.7 against 51.6): a long row launched last keeps
    its SMs busy after the others are done. Lengths on the host are sorted there and the order
    copied to ``out``'s device from pinned memory, without waiting for the GPU."""
    order = torch.argsort(seq_lens, descending=True).to(torch.int32)
    if out is None:
        return order
    if order.device != out.device and out.device.type == "cuda":
        order = order.pin_memory()
    return out.copy_(order, non_blocking=True)


def warm_up(cache: torch.Tensor, fmt: KVPageFormat | MergedLayer | SalientTokensFormat, num_query_heads: int,
            query_dtype: torch.dtype, window: int | None = None, lse_out: bool = False) -> None:
    """Compile every decode-kernel variant a serving step may launch for this page format, split
    or not: decode rows in a given order, and prompt rows in groups continuing a prior attention
    (``prompt.paged_prompt``); a sliding-window layer's (``window``) see their windows; with
    ``lse_out`` (``salient_decode``), decode rows continue a prior too and both leave the merged
    log-sum-exp. vLLM's own warm-up (a large prefill, then decode-only CUDA graphs)
    reaches only some of them, and each compile in the middle of serving (about half a second)
    stalls every request of that step. Launches one row over page 0; outputs are discarded."""
    dev = cache.device
    query = torch.zeros(1, num_query_heads, fmt.k.head_size, dtype=query_dtype, device=dev)
    block_table = torch.zeros(1, 2, dtype=torch.int32, device=dev)
    seq_lens = torch.ones(1, dtype=torch.int32, device=dev)
    one_group = TokenGroups(seq_lens, torch.zeros(1, dtype=torch.int32, device=dev),
                            rows_per_program(num_query_heads // fmt.k.num_heads))
    first = torch.zeros(1, dtype=torch.int32, device=dev)
    prior = torch.zeros(num_query_heads, 1, dtype=torch.float32, device=dev)
    options = {}
    if window is not None:
        options.update(window=window, first_keys=first)
    decode_prior = dict(prior_lse=prior, lse_out=True) if lse_out else {}
    for num_splits in (1, 2):
        paged_decode(query, cache, fmt, block_table, seq_lens, 1.0, 2 * fmt.block_size, num_splits=num_splits,
                     row_order=first, **decode_prior, **options)
        paged_decode(query, cache, fmt, block_table, seq_lens, 1.0, 2 * fmt.block_size, num_splits=num_splits,
                     groups=one_group, prior_lse=prior, lse_out=lse_out, **options)
