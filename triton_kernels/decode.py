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

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats import KVPageFormat

from .layout import page_layout


@triton.jit
def _gathered_codes(row_ptr, D: tl.constexpr, BITS: tl.constexpr):
    """Codes [T, D] of packed rows as float16 (see ``_as_fp16``), one load per channel (8 and 3 bits)."""
    d = tl.arange(0, D)[None, :]
    if BITS == 8:
        c = tl.load(row_ptr + d)
    elif BITS == 4:
        c = (tl.load(row_ptr + d // 2).to(tl.int32) >> ((d % 2) * 4)) & 15
    elif BITS == 2:
        c = (tl.load(row_ptr + d // 4).to(tl.int32) >> ((d % 4) * 2)) & 3
    else:  # 3 bits: ten 3-bit codes + one 2-bit code per little-endian 32-bit word
        w = tl.load((row_ptr + (d // 11) * 4).to(tl.pointer_type(tl.int32)))
        c = (w >> ((d % 11) * 3)) & tl.where(d % 11 == 10, 3, 7)
    return _as_fp16(c)


@triton.jit
def _as_fp16(codes):
    """Integer codes as float16 ``1024 + code``: the code OR'd into the mantissa of 1024.0 (0x6400),
    with no int-to-float conversion (whose throughput is a quarter of integer logic's). Callers
    subtract 1024 times the other factor's sum."""
    return ((codes.to(tl.int32) | 0x6400).to(tl.int16)).to(tl.float16, bitcast=True)


@triton.jit
def _plane(packed, K: tl.constexpr, BITS: tl.constexpr):
    """Field K of each byte: the codes of channels byte * (8 // BITS) + K."""
    return _as_fp16((packed >> (K * BITS)) & ((1 << BITS) - 1))


@triton.jit
def _accumulate_plane(acc, alpha, ps, pz, packed, K: tl.constexpr, BITS: tl.constexpr, channel_scale):
    """Rescaled running output of plane K plus this tile's share: (p*s) . codes + p . zero, times
    the ZipCache channel scale (1.0 without)."""
    return acc * alpha + (tl.dot(ps, _plane(packed, K, BITS)) + pz) * channel_scale


@triton.jit
def _f32(ptr):
    return tl.load(ptr).to(tl.float32)


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, half_ptr, block_table_ptr, seq_lens_ptr, out_ptr, part_ptr,
    sm_scale, bt_stride, page_bytes, page_halves, blocks_per_split,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    K_BITS: tl.constexpr, KP: tl.constexpr, K_CODES: tl.constexpr, K_ROW: tl.constexpr, K_SCALE: tl.constexpr,
    K_ZERO: tl.constexpr,
    V_BITS: tl.constexpr, VP: tl.constexpr, V_CODES: tl.constexpr, V_ROW: tl.constexpr, V_SCALE: tl.constexpr,
    V_ZERO: tl.constexpr, V_CS: tl.constexpr,
):
    """KP / VP: planes of K / V (8 // bits for 2, 4, 8 bits read as byte planes; 1 otherwise).
    Plane k holds channels ``j * P + k``; queries, scales and the output are read and written
    per plane, so packed bytes go to the tensor cores without being interleaved.

    ``half_ptr`` is the cache seen as float16 (K's scales and zeros are read through it, so that
    the compiler knows their alignment and vectorizes the loads).

    Program ``(seq * H + h, split)``: the KV heads of one request are neighbours in launch
    order, so the pages they share (rows of all heads lie side by side) are read from memory
    once and from L2 by the others."""
    h = tl.program_id(0) % H
    seq = tl.program_id(0) // H
    split = tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    L = tl.load(seq_lens_ptr + seq)
    b_start = split * blocks_per_split
    b_end = tl.minimum(b_start + blocks_per_split, tl.cdiv(L, BLOCK))

    g = tl.arange(0, GP)
    heads = h * G + g
    q_row = q_ptr + (seq * H * G + heads[:, None]) * D
    gmask = (g < G)[:, None]
    DK: tl.constexpr = D // KP
    DV: tl.constexpr = D // VP
    dk = tl.arange(0, DK)[None, :]
    dv = tl.arange(0, DV)[None, :]
    d = tl.arange(0, D)[None, :]
    q = tl.load(q_row + d, mask=gmask, other=0.0)
    q0 = tl.load(q_row + dk * KP, mask=gmask, other=0.0).to(tl.float32)
    if KP > 1:
        q1 = tl.load(q_row + dk * KP + 1, mask=gmask, other=0.0).to(tl.float32)
    if KP > 2:
        q2 = tl.load(q_row + dk * KP + 2, mask=gmask, other=0.0).to(tl.float32)
        q3 = tl.load(q_row + dk * KP + 3, mask=gmask, other=0.0).to(tl.float32)

    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc0 = tl.zeros([GP, DV], tl.float32)
    if VP > 1:
        acc1 = tl.zeros([GP, DV], tl.float32)
    if VP > 2:
        acc2 = tl.zeros([GP, DV], tl.float32)
        acc3 = tl.zeros([GP, DV], tl.float32)
    for b in range(b_start, b_end):
        block_id = tl.load(block_table_ptr + seq * bt_stride + b).to(tl.int64)
        page = cache_ptr + block_id * page_bytes
        half = half_ptr + block_id * page_halves
        if K_BITS != 16:  # per-channel scale and zero, read per plane
            kstat = half + h * D + dk * KP
            ks0 = _f32(kstat + K_SCALE // 2)
            if K_BITS == 3:
                ks0 = ks0 * tl.where(dk % 11 == 10, 7.0 / 3.0, 1.0)
            kz0 = _f32(kstat + K_ZERO // 2)
            qs0 = (q0 * ks0).to(tl.float16)
            bias = tl.sum(q0 * kz0, 1)
            bias -= 1024.0 * tl.sum(qs0.to(tl.float32), 1)  # codes enter the dots as 1024 + code
            if KP > 1:
                qs1 = (q1 * _f32(kstat + 1 + K_SCALE // 2)).to(tl.float16)
                bias += tl.sum(q1 * _f32(kstat + 1 + K_ZERO // 2), 1)
                bias -= 1024.0 * tl.sum(qs1.to(tl.float32), 1)
            if KP > 2:
                qs2 = (q2 * _f32(kstat + 2 + K_SCALE // 2)).to(tl.float16)
                qs3 = (q3 * _f32(kstat + 3 + K_SCALE // 2)).to(tl.float16)
                bias += tl.sum(q2 * _f32(kstat + 2 + K_ZERO // 2), 1) + tl.sum(q3 * _f32(kstat + 3 + K_ZERO // 2), 1)
                bias -= 1024.0 * (tl.sum(qs2.to(tl.float32), 1) + tl.sum(qs3.to(tl.float32), 1))
        if V_CS >= 0:  # ZipCache channel scales, per plane
            vcs = half + V_CS // 2 + h * D + dv * VP
            cs0 = _f32(vcs)
            if VP > 1:
                cs1 = _f32(vcs + 1)
            if VP > 2:
                cs2 = _f32(vcs + 2)
                cs3 = _f32(vcs + 3)
        else:
            cs0 = 1.0
            cs1 = 1.0
            cs2 = 1.0
            cs3 = 1.0
        for t0 in range(0, BLOCK, TILE):
            tok = t0 + tl.arange(0, TILE)
            valid = b * BLOCK + tok < L
            k_row = page + K_CODES + (tok[:, None] * H + h) * K_ROW
            if K_BITS == 16:
                s = tl.dot(q, tl.trans(tl.load(k_row.to(tl.pointer_type(dtype)) + d)))
            elif KP == 1:  # 8 bits, or 3 bits gathered
                s = tl.dot(qs0, tl.trans(_gathered_codes(k_row, D, K_BITS))) + bias[:, None]
            else:
                kb = tl.load(k_row + dk)
                s = tl.dot(qs0, tl.trans(_plane(kb, 0, K_BITS)))
                s += tl.dot(qs1, tl.trans(_plane(kb, 1, K_BITS)))
                if KP > 2:
                    s += tl.dot(qs2, tl.trans(_plane(kb, 2, K_BITS)))
                    s += tl.dot(qs3, tl.trans(_plane(kb, 3, K_BITS)))
                s += bias[:, None]
            s = tl.where(valid[None, :], s * sm_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)[:, None]
            p = tl.exp(s - m_new[:, None])
            l = l * tl.reshape(alpha, (GP,)) + tl.sum(p, 1)
            m = m_new
            v_row = page + V_CODES + (tok[:, None] * H + h) * V_ROW
            if V_BITS == 16:
                acc0 = acc0 * alpha + tl.dot(p.to(dtype), tl.load(v_row.to(tl.pointer_type(dtype)) + d))
            else:
                # through the byte pointer: with their alignment known, the compiler pipelines these
                # loads too and needs 196 registers instead of 122 (a third of the occupancy)
                vs = tl.load((page + V_SCALE + (h * BLOCK + tok) * 2).to(tl.pointer_type(tl.float16))).to(tl.float32)
                vz = tl.load((page + V_ZERO + (h * BLOCK + tok) * 2).to(tl.pointer_type(tl.float16))).to(tl.float32)
                ps = (p * vs[None, :]).to(tl.float16)
                pz = tl.sum(p * vz[None, :], 1)[:, None]
                pm = 1024.0 * tl.sum(ps.to(tl.float32), 1)[:, None]  # codes enter the dot as 1024 + code
                if VP == 1:  # 8 bits, or 3 bits gathered
                    pv = tl.dot(ps, _gathered_codes(v_row, D, V_BITS)) - pm
                    if V_BITS == 3:
                        pv = pv * tl.where(dv % 11 == 10, 7.0 / 3.0, 1.0)
                    acc0 = acc0 * alpha + (pv + pz) * cs0
                else:
                    vb = tl.load(v_row + dv)
                    pz -= pm
                    acc0 = _accumulate_plane(acc0, alpha, ps, pz, vb, 0, V_BITS, cs0)
                    acc1 = _accumulate_plane(acc1, alpha, ps, pz, vb, 1, V_BITS, cs1)
                    if VP > 2:
                        acc2 = _accumulate_plane(acc2, alpha, ps, pz, vb, 2, V_BITS, cs2)
                        acc3 = _accumulate_plane(acc3, alpha, ps, pz, vb, 3, V_BITS, cs3)

    if NUM_SPLITS == 1:
        dst = out_ptr + (seq * H * G + heads[:, None]) * D + dv * VP
        tl.store(dst, (acc0 / l[:, None]).to(dtype), mask=gmask)
        if VP > 1:
            tl.store(dst + 1, (acc1 / l[:, None]).to(dtype), mask=gmask)
        if VP > 2:
            tl.store(dst + 2, (acc2 / l[:, None]).to(dtype), mask=gmask)
            tl.store(dst + 3, (acc3 / l[:, None]).to(dtype), mask=gmask)
    else:
        base = part_ptr + ((seq * H * G + heads[:, None]) * NUM_SPLITS + split) * (D + 2)
        tl.store(base + dv * VP, acc0, mask=gmask)
        if VP > 1:
            tl.store(base + dv * VP + 1, acc1, mask=gmask)
        if VP > 2:
            tl.store(base + dv * VP + 2, acc2, mask=gmask)
            tl.store(base + dv * VP + 3, acc3, mask=gmask)
        tl.store(base + D + tl.zeros([GP, 1], tl.int32), m[:, None], mask=gmask)
        tl.store(base + D + 1 + tl.zeros([GP, 1], tl.int32), l[:, None], mask=gmask)


@triton.jit
def _merge_splits_kernel(part_ptr, out_ptr, HQ: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    row = tl.program_id(0) * HQ + tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D)
    base = part_ptr + (row * NUM_SPLITS + s) * (D + 2)
    m = tl.load(base + D)
    l = tl.load(base + D + 1)
    acc = tl.load(base[:, None] + d[None, :])
    w = tl.exp(m - tl.max(m, 0))
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))


def _planes(bits: int) -> int:
    return 8 // bits if bits in (2, 4) else 1


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_size: int,
                      device: torch.device, programs_per_sm: int = 2) -> int:
    """Enough programs to give each SM ``programs_per_sm``, at least one block per split, a power of two."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, -(-programs_per_sm * sms // (num_seqs * num_kv_heads)))
    max_blocks = max(1, -(-max_seq_len // block_size))
    return min(triton.next_power_of_2(want), triton.next_power_of_2(max_blocks), 64)


def kernel_constants(fmt: KVPageFormat, group: int, num_splits: int, tile: int | None = None) -> dict:
    """The decode kernel's compile-time constants for a page format and query heads per KV head."""
    lay = page_layout(fmt)
    d = lay.head_size
    return dict(
        H=lay.num_kv_heads, G=group, GP=max(16, triton.next_power_of_2(group)), D=d, BLOCK=lay.block_size,
        TILE=tile or min(lay.block_size, 64 if d <= 128 else 32), NUM_SPLITS=num_splits,
        K_BITS=lay.k.bits, KP=_planes(lay.k.bits), K_CODES=lay.k.codes, K_ROW=lay.k.row_bytes,
        K_SCALE=lay.k.scale, K_ZERO=lay.k.zero,
        V_BITS=lay.v.bits, VP=_planes(lay.v.bits), V_CODES=lay.v.codes, V_ROW=lay.v.row_bytes,
        V_SCALE=lay.v.scale, V_ZERO=lay.v.zero, V_CS=lay.v.channel_scale,
    )


def paged_decode(query: torch.Tensor, cache: torch.Tensor, fmt: KVPageFormat, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, sm_scale: float, max_seq_len: int, num_splits: int | None = None,
                 out: torch.Tensor | None = None, tile: int | None = None, num_warps: int = 4,
                 programs_per_sm: int = 2) -> torch.Tensor:
    """Attention of one new token per request (``query`` [N, Hq, D]) over its pages.

    ``cache`` is the layer's pages as ``[num_blocks, page_bytes]`` uint8;
    ``block_table`` [N, max_blocks] and ``seq_lens`` [N] (context length,
    the new token included) are int32 on the same device.
    """
    query = query.contiguous()  # a prefill batch's queries may arrive as a view into the fused QKV output
    n, hq, d = query.shape
    h = fmt.k.num_heads
    if num_splits is None:
        num_splits = choose_num_splits(n, h, max_seq_len, fmt.block_size, query.device, programs_per_sm)
    max_blocks = max(1, -(-max_seq_len // fmt.block_size))
    blocks_per_split = -(-max_blocks // num_splits)
    if out is None:
        out = torch.empty_like(query)
    part = out
    if num_splits > 1:
        part = torch.empty(n, hq, num_splits, d + 2, dtype=torch.float32, device=query.device)
    _decode_kernel[(n * h, num_splits)](
        query, cache, cache.view(torch.float16), block_table, seq_lens, out, part,
        sm_scale, block_table.stride(0), fmt.page_bytes, fmt.page_bytes // 2, blocks_per_split,
        **kernel_constants(fmt, hq // h, num_splits, tile), num_warps=num_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(n, hq)](part, out, HQ=hq, D=d, NUM_SPLITS=num_splits)
    return out
