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
def _codes(row_ptr, D: tl.constexpr, BITS: tl.constexpr):
    """Integer codes [T, D] of packed rows (row_ptr: [T, 1] uint8 pointers).

    2/4/8 bits load whole bytes contiguously and interleave the fields with
    join/reshape, so the loads vectorize; 3-bit words are gathered per channel.
    """
    if BITS == 8:
        c = tl.load(row_ptr + tl.arange(0, D)[None, :]).to(tl.int32)
    elif BITS == 4:
        b = tl.load(row_ptr + tl.arange(0, D // 2)[None, :]).to(tl.int32)
        c = tl.reshape(tl.join(b & 15, b >> 4), (b.shape[0], D))
    elif BITS == 2:
        b = tl.load(row_ptr + tl.arange(0, D // 4)[None, :]).to(tl.int32)
        c = tl.join(tl.join(b & 3, (b >> 4) & 3), tl.join((b >> 2) & 3, b >> 6))
        c = tl.reshape(c, (b.shape[0], D))
    else:  # 3 bits: ten 3-bit codes + one 2-bit code per little-endian 32-bit word
        d = tl.arange(0, D)[None, :]
        w = tl.load((row_ptr + (d // 11) * 4).to(tl.pointer_type(tl.int32)))
        c = (w >> ((d % 11) * 3)) & tl.where(d % 11 == 10, 3, 7)
    return c


@triton.jit
def _fp16(ptr):
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr, part_ptr,
    sm_scale, bt_stride, page_bytes, blocks_per_split,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    K_BITS: tl.constexpr, K_CODES: tl.constexpr, K_ROW: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
    V_BITS: tl.constexpr, V_CODES: tl.constexpr, V_ROW: tl.constexpr, V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
    V_CS: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    dtype = q_ptr.dtype.element_ty
    L = tl.load(seq_lens_ptr + seq)
    b_start = split * blocks_per_split
    b_end = tl.minimum(b_start + blocks_per_split, tl.cdiv(L, BLOCK))

    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    heads = h * G + g
    q = tl.load(q_ptr + (seq * H * G + heads[:, None]) * D + d[None, :], mask=(g < G)[:, None], other=0.0)
    qf = q.to(tl.float32)
    if K_BITS == 3:
        k_step = tl.where(d % 11 == 10, 7.0 / 3.0, 1.0)
    if V_BITS == 3:
        v_step = tl.where(d % 11 == 10, 7.0 / 3.0, 1.0)

    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for b in range(b_start, b_end):
        page = cache_ptr + tl.load(block_table_ptr + seq * bt_stride + b).to(tl.int64) * page_bytes
        if K_BITS != 16:
            ks = _fp16(page + K_SCALE + (h * D + d) * 2)
            if K_BITS == 3:
                ks = ks * k_step
            kz = _fp16(page + K_ZERO + (h * D + d) * 2)
            q_scaled = (qf * ks[None, :]).to(tl.float16)
            q_bias = tl.sum(qf * kz[None, :], 1)
        if V_CS >= 0:
            vcs = _fp16(page + V_CS + (h * D + d) * 2)
        for t0 in range(0, BLOCK, TILE):
            tok = t0 + tl.arange(0, TILE)
            valid = b * BLOCK + tok < L
            if K_BITS == 16:
                k = tl.load((page + K_CODES + (tok[:, None] * H + h) * K_ROW).to(tl.pointer_type(dtype)) + d[None, :])
                s = tl.dot(q, tl.trans(k))
            else:
                kc = _codes(page + K_CODES + (tok[:, None] * H + h) * K_ROW, D, K_BITS)
                s = tl.dot(q_scaled, tl.trans(kc.to(tl.float16))) + q_bias[:, None]
            s = tl.where(valid[None, :], s * sm_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            if V_BITS == 16:
                v = tl.load((page + V_CODES + (tok[:, None] * H + h) * V_ROW).to(tl.pointer_type(dtype)) + d[None, :])
                pv = tl.dot(p.to(dtype), v)
            else:
                vs = _fp16(page + V_SCALE + (tok * H + h) * 2)
                vz = _fp16(page + V_ZERO + (tok * H + h) * 2)
                vc = _codes(page + V_CODES + (tok[:, None] * H + h) * V_ROW, D, V_BITS)
                pv = tl.dot((p * vs[None, :]).to(tl.float16), vc.to(tl.float16))
                if V_BITS == 3:
                    pv = pv * v_step[None, :]
                pv = pv + tl.sum(p * vz[None, :], 1)[:, None]
            if V_CS >= 0:
                pv = pv * vcs[None, :]
            acc = acc * alpha[:, None] + pv
            m = m_new

    hmask = (g < G)[:, None]
    if NUM_SPLITS == 1:
        out = acc / l[:, None]
        tl.store(out_ptr + (seq * H * G + heads[:, None]) * D + d[None, :], out.to(dtype), mask=hmask)
    else:
        base = part_ptr + ((seq * H * G + heads[:, None]) * NUM_SPLITS + split) * (D + 2)
        tl.store(base + d[None, :], acc, mask=hmask)
        tl.store(base + D + tl.zeros([GP, 1], tl.int32), m[:, None], mask=hmask)
        tl.store(base + D + 1 + tl.zeros([GP, 1], tl.int32), l[:, None], mask=hmask)


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


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_size: int,
                      device: torch.device) -> int:
    """Enough programs to fill the GPU twice over, at least one block per split, a power of two."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = max(1, -(-2 * sms // (num_seqs * num_kv_heads)))
    max_blocks = max(1, -(-max_seq_len // block_size))
    return min(triton.next_power_of_2(want), triton.next_power_of_2(max_blocks), 64)


def paged_decode(query: torch.Tensor, cache: torch.Tensor, fmt: KVPageFormat, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, sm_scale: float, max_seq_len: int, num_splits: int | None = None,
                 out: torch.Tensor | None = None, tile: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Attention of one new token per request (``query`` [N, Hq, D]) over its pages.

    ``cache`` is the layer's pages as ``[num_blocks, page_bytes]`` uint8;
    ``block_table`` [N, max_blocks] and ``seq_lens`` [N] (context length,
    the new token included) are int32 on the same device.
    """
    lay = page_layout(fmt)
    n, hq, d = query.shape
    h = lay.num_kv_heads
    g = hq // h
    if num_splits is None:
        num_splits = choose_num_splits(n, h, max_seq_len, lay.block_size, query.device)
    max_blocks = max(1, -(-max_seq_len // lay.block_size))
    blocks_per_split = -(-max_blocks // num_splits)
    if out is None:
        out = torch.empty_like(query)
    part = out
    if num_splits > 1:
        part = torch.empty(n, hq, num_splits, d + 2, dtype=torch.float32, device=query.device)
    _decode_kernel[(n, h, num_splits)](
        query, cache, block_table, seq_lens, out, part,
        sm_scale, block_table.stride(0), lay.page_bytes, blocks_per_split,
        H=h, G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BLOCK=lay.block_size,
        TILE=tile or min(lay.block_size, 64 if d <= 128 else 32), NUM_SPLITS=num_splits,
        K_BITS=lay.k.bits, K_CODES=lay.k.codes, K_ROW=lay.k.row_bytes, K_SCALE=lay.k.scale, K_ZERO=lay.k.zero,
        V_BITS=lay.v.bits, V_CODES=lay.v.codes, V_ROW=lay.v.row_bytes, V_SCALE=lay.v.scale, V_ZERO=lay.v.zero,
        V_CS=lay.v.channel_scale, num_warps=num_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(n, hq)](part, out, HQ=hq, D=d, NUM_SPLITS=num_splits)
    return out
