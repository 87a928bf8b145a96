"""Outlier tokens on the GPU (``formats.outliers``): a block's first write chooses them.

Before the write kernel (``write.write_tokens``), one program per (new token, KV head) whose token
opens a block (offset 0: the block's first write is in this step) counts the block's new tokens.
With no more than ``count`` of them it marks the block as keeping none (a recycled page holds
another request's offsets); otherwise it scores them as ``outliers.deviation`` does (each token's
largest z-score over K's channels, mean and population standard deviation of the block's new tokens
per channel, IEEE division and square root), keeps the ``count`` highest (lowest offset first among
equals) and stores their offsets and their K and V rows, each coded on its own grid as
``outliers.quantize_rows`` codes it, in the page's slots. The write kernel then
leaves those rows out of K's statistics. Blocks a step appends to keep their outliers: their
programs do nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats import KVPageFormat, outliers

from .addressing import pack_units
from .grid import code_on, min_max_stats
from .launch import Variant, launch

_EPS = tl.constexpr(outliers.DEVIATION_EPS)


@triton.jit
def _store_row(x, codes_at, stats_at, BITS: tl.constexpr, D: tl.constexpr):
    """Code one row ``x`` [D] float32 on its min-max grid (``outliers.quantize_rows``): packed codes
    (``packing``'s order) at ``codes_at``, float16 zero and scale at ``stats_at``."""
    top: tl.constexpr = (1 << BITS) - 1
    per_byte: tl.constexpr = 8 // BITS
    zero, scale = min_max_stats(tl.min(x, 0), tl.max(x, 0), top)
    q = tl.minimum(tl.maximum(code_on(x, zero.to(tl.float32), scale.to(tl.float32)), 0.0), top)
    codes = tl.reshape(q.to(tl.uint32), [D // per_byte, per_byte])
    tl.store(codes_at + tl.arange(0, D // per_byte), pack_units(codes, tl.arange(0, per_byte)[None, :], 1, BITS))
    tl.store(stats_at, zero)
    tl.store(stats_at + 1, scale)


@triton.jit(do_not_specialize=["num_tokens"])
def _select_kernel(k_ptr, v_ptr, slot_ptr, cache_ptr, num_tokens, page_bytes, k_stride, v_stride, H: tl.constexpr,
                   D: tl.constexpr, BLOCK: tl.constexpr, COUNT: tl.constexpr, CP: tl.constexpr, INDEX: tl.constexpr,
                   K_CODES: tl.constexpr, V_CODES: tl.constexpr, STATS: tl.constexpr, K_BITS: tl.constexpr,
                   V_BITS: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if (slot >= 0) & (slot % BLOCK == 0):
        page = cache_ptr + (slot // BLOCK) * page_bytes
        index = (page + INDEX).to(tl.pointer_type(tl.int16)) + h * COUNT
        t = tl.arange(0, BLOCK)
        j = i + t
        in_batch = j < num_tokens
        is_new = in_batch & (tl.load(slot_ptr + j, mask=in_batch, other=-1).to(tl.int64) == slot + t)
        n = tl.sum(is_new.to(tl.int32), 0)
        if n <= COUNT:
            c = tl.arange(0, CP)
            tl.store(index + c, tl.full([CP], -1, tl.int16), mask=c < COUNT)
        else:
            d = tl.arange(0, D)[None, :]
            rows = is_new[:, None]
            k = tl.load(k_ptr + j[:, None] * k_stride + h * D + d, mask=rows, other=0.0).to(tl.float32)
            mean = tl.math.div_rn(tl.sum(k, 0), n.to(tl.float32) + tl.zeros([D], tl.float32))
            dev = tl.where(rows, k - mean[None, :], 0.0)
            var = tl.math.div_rn(tl.sum(dev * dev, 0), n.to(tl.float32) + tl.zeros([D], tl.float32))
            std = tl.math.sqrt_rn(var) + _EPS
            z = tl.max(tl.math.div_rn(tl.abs(dev), std[None, :] + tl.zeros_like(dev)), 1)
            score = tl.where(is_new, z, float("-inf"))
            stats = (page + STATS).to(tl.pointer_type(tl.float16))
            dd = tl.arange(0, D)
            for c in tl.static_range(COUNT):
                top = tl.max(score, 0)
                at = tl.min(tl.where(score == top, t, BLOCK), 0)  # the lowest offset among equals
                tl.store(index + c, at.to(tl.int16))
                score = tl.where(t == at, float("-inf"), score)
                _store_row(tl.load(k_ptr + (i + at) * k_stride + h * D + dd).to(tl.float32),
                           page + K_CODES + (c * H + h) * (D * K_BITS // 8), stats + (c * 2 * H + h) * 2, K_BITS, D)
                _store_row(tl.load(v_ptr + (i + at) * v_stride + h * D + dd).to(tl.float32),
                           page + V_CODES + (c * H + h) * (D * V_BITS // 8), stats + (c * 2 * H + H + h) * 2, V_BITS, D)


@functools.cache
def _variant(fmt: KVPageFormat) -> Variant:
    return Variant(_select_kernel, dict(H=fmt.k.num_heads, D=fmt.k.head_size, BLOCK=fmt.block_size,
                                        COUNT=fmt.outliers, CP=triton.next_power_of_2(fmt.outliers),
                                        INDEX=fmt.outlier_at("index"), K_CODES=fmt.outlier_at("k_codes"),
                                        V_CODES=fmt.outlier_at("v_codes"), STATS=fmt.outlier_at("stats"),
                                        K_BITS=outliers.K_BITS, V_BITS=outliers.V_BITS), {"num_warps": 4})


def choose_outliers(cache: torch.Tensor, fmt: KVPageFormat, key: torch.Tensor, value: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Choose the outliers of the blocks this step writes first (``key``/``value`` [N, H, D], new
    tokens at ``slot_mapping``; row-strided views, as for the write) and store them in their pages."""
    n = slot_mapping.shape[0]
    if n:
        launch(_variant(fmt), (n, fmt.k.num_heads),
               (key, value, slot_mapping, cache, n, fmt.page_bytes, key.stride(0), value.stride(0)))
