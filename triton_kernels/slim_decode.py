"""Decode attention over K-only pages (slim attention, MHA; 16-bit K, or 8-bit codes per channel).

Head h's output is ``(softmax(q_h K_h^T) K_pre) W_KV[:, h]``, where the weighted
sum runs over *all* heads' K (rotated back to before RoPE). Two passes, each
reading the pages once:

1. ``_scores_kernel``, one program per (request, head): the scores ``q_h . K_h`` and their
   softmax statistics (max, sum of exponentials), computed as it goes.
2. ``_mix_kernel``, one program per (request, K head c): ``P [H, T] @ RoPE^-1(K_c) [T, D]``,
   with ``P`` made from the scores and statistics on the fly,
   the columns ``c*D .. c*D+D`` of every head's weighted sum, as tensor-core dots.

A batched product with ``W_KV`` per head finishes it. Neither V nor a
full-precision copy of K is ever written. Both grids put a request's heads next to
each other, so the 32 mix programs of a request find its scores and the RoPE rows in L2.

Runs inside a full CUDA graph: the scores' buffer is sized for ``max_seq_len``, which
the backend sets to the model's longest context under capture ([rows, H, max_model_len]
float32: 134 MB for 512 rows of 32 heads at 2,048 tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.formats.layout import page_layout


@triton.jit
def _load_k(page, tok, h, cols, valid, dtype, BITS: tl.constexpr, CODES: tl.constexpr, SCALE: tl.constexpr,
            ZERO: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """K of tokens ``tok`` (of one page), head ``h``, channels ``cols``, as float32: 16-bit values
    token-major ``[B, H, D]``, or 8-bit codes head-major ``[H, B, D]`` with a float16 scale and zero
    per (head, channel) of the page (``MinMaxCodec``, statistics per channel)."""
    if BITS == 16:
        return tl.load((page + CODES).to(tl.pointer_type(dtype)) + (tok[:, None] * H + h) * D + cols[None, :],
                       mask=valid[:, None], other=0.0).to(tl.float32)
    else:
        codes = tl.load(page + CODES + (h * BLOCK + tok[:, None]) * D + cols[None, :], mask=valid[:, None], other=0)
        scale = tl.load((page + SCALE).to(tl.pointer_type(tl.float16)) + h * D + cols).to(tl.float32)
        zero = tl.load((page + ZERO).to(tl.pointer_type(tl.float16)) + h * D + cols).to(tl.float32)
        return codes.to(tl.float32) * scale[None, :] + zero[None, :]


@triton.jit
def _scores_kernel(q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, s_ptr, stats_ptr, sm_scale, bt_stride, page_bytes,
                   s_stride, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
                   STAGES: tl.constexpr, BITS: tl.constexpr, CODES: tl.constexpr, SCALE: tl.constexpr,
                   ZERO: tl.constexpr):
    """Scores of one (request, head), and their softmax statistics: max and sum of exp(s - max)."""
    h = tl.program_id(0)
    seq = tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    L = tl.load(seq_lens_ptr + seq)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (seq * H + h) * D + d).to(tl.float32)
    m = tl.full([TILE], float("-inf"), tl.float32)  # running per lane, combined at the end
    l = tl.zeros([TILE], tl.float32)
    for p0 in tl.range(0, L, TILE, num_stages=STAGES):  # one loop over the context: pipelined across pages
        page = cache_ptr + tl.load(block_table_ptr + seq * bt_stride + p0 // BLOCK).to(tl.int64) * page_bytes
        tok = p0 % BLOCK + tl.arange(0, TILE)
        pos = p0 + tl.arange(0, TILE)
        valid = pos < L
        k = _load_k(page, tok, h, d, valid, dtype, BITS, CODES, SCALE, ZERO, H, D, BLOCK)
        s = tl.where(valid, tl.sum(k * q[None, :], 1) * sm_scale, float("-inf"))
        tl.store(s_ptr + (seq * H + h) * s_stride + pos, s, mask=valid)
        m_new = tl.maximum(m, s)
        l = l * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.where(valid, tl.exp(s - m_new), 0.0)
        m = m_new
    m_all = tl.max(m, 0)
    l_all = tl.sum(l * tl.exp(tl.where(m == float("-inf"), float("-inf"), m - m_all)), 0)
    tl.store(stats_ptr + (seq * H + h) * 2, m_all)
    tl.store(stats_ptr + (seq * H + h) * 2 + 1, l_all)


@triton.jit
def _mix_kernel(s_ptr, stats_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, cos_sin_ptr, out_ptr, bt_stride, page_bytes,
                p_stride, cs_stride, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                TILE: tl.constexpr, STAGES: tl.constexpr, BITS: tl.constexpr, CODES: tl.constexpr,
                SCALE: tl.constexpr, ZERO: tl.constexpr):
    """Probabilities ``exp(s - max) / sum`` from the first pass's scores and statistics; NeoX
    rotation over the whole head: ``pre = (k1 cos + k2 sin, k2 cos - k1 sin)`` on the halves.
    Writes ``out [H, rows, H*D]`` (head-major, as the W_KV product takes it)."""
    c = tl.program_id(0)
    seq = tl.program_id(1)
    rows = tl.num_programs(1)
    dtype = out_ptr.dtype.element_ty  # the model's: K in the pages and the result
    HALF: tl.constexpr = D // 2
    L = tl.load(seq_lens_ptr + seq)
    heads = tl.arange(0, HP)
    hmask = heads < H
    m = tl.load(stats_ptr + (seq * H + heads) * 2, mask=hmask, other=0.0)[:, None]
    inv_l = 1.0 / tl.load(stats_ptr + (seq * H + heads) * 2 + 1, mask=hmask, other=1.0)[:, None]
    dh = tl.arange(0, HALF)
    acc1 = tl.zeros([HP, HALF], tl.float32)
    acc2 = tl.zeros([HP, HALF], tl.float32)
    for p0 in tl.range(0, L, TILE, num_stages=STAGES):
        page = cache_ptr + tl.load(block_table_ptr + seq * bt_stride + p0 // BLOCK).to(tl.int64) * page_bytes
        tok = p0 % BLOCK + tl.arange(0, TILE)
        pos = p0 + tl.arange(0, TILE)
        valid = pos < L
        both = hmask[:, None] & valid[None, :]
        s = tl.load(s_ptr + (seq * H + heads[:, None]) * p_stride + pos[None, :], mask=both, other=0.0)
        p = tl.where(both, tl.exp(s - m) * inv_l, 0.0)
        k1 = _load_k(page, tok, c, dh, valid, dtype, BITS, CODES, SCALE, ZERO, H, D, BLOCK)
        k2 = _load_k(page, tok, c, HALF + dh, valid, dtype, BITS, CODES, SCALE, ZERO, H, D, BLOCK)
        cs = cos_sin_ptr + pos[:, None] * cs_stride + dh[None, :]
        cos = tl.load(cs, mask=valid[:, None], other=0.0).to(tl.float32)
        sin = tl.load(cs + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
        pf = p.to(tl.float16)
        acc1 += tl.dot(pf, (k1 * cos + k2 * sin).to(tl.float16))
        acc2 += tl.dot(pf, (k2 * cos - k1 * sin).to(tl.float16))
    dst = out_ptr + (heads[:, None] * rows + seq) * (H * D) + c * D + dh[None, :]
    tl.store(dst, acc1.to(dtype), mask=hmask[:, None])
    tl.store(dst + HALF, acc2.to(dtype), mask=hmask[:, None])


# Each pass's (tokens a step, warps, pipeline stages), tokens at most a page's: the fastest of a sweep on
# an H200 (docs/slim.md); 16 tokens in 1 stage for the mix took 1.5x as long.
SCORES_TUNING = (64, 8, 1)
MIX_TUNING = (32, 4, 2)


def _where_k(fmt: KVPageFormat) -> dict:
    k = page_layout(fmt).k
    return dict(BITS=k.bits, CODES=k.codes, SCALE=k.scale, ZERO=k.zero)


def scores_pass(query: torch.Tensor, cache: torch.Tensor, fmt: KVPageFormat, block_table: torch.Tensor,
                seq_lens: torch.Tensor, sm_scale: float, scores: torch.Tensor, stats: torch.Tensor,
                tuning: tuple[int, int, int] = SCORES_TUNING) -> None:
    """``scores`` [N, H, S] and their softmax ``stats`` [N, H, 2] of ``query`` [N, H, D] (contiguous)."""
    n, h, d = query.shape
    tile, warps, stages = tuning
    _scores_kernel[(h, n)](query, cache, block_table, seq_lens, scores, stats, sm_scale, block_table.stride(0),
                           fmt.page_bytes, scores.stride(1), H=h, D=d, BLOCK=fmt.block_size,
                           TILE=min(tile, fmt.block_size), STAGES=stages, num_warps=warps, **_where_k(fmt))


def mix_pass(scores: torch.Tensor, stats: torch.Tensor, cache: torch.Tensor, fmt: KVPageFormat,
             block_table: torch.Tensor, seq_lens: torch.Tensor, cos_sin: torch.Tensor, mixed: torch.Tensor,
             tuning: tuple[int, int, int] = MIX_TUNING) -> None:
    """Every head's probability-weighted sum of ``RoPE^-1(K)`` into ``mixed`` [H, N, H*D]."""
    h, n, _ = mixed.shape
    tile, warps, stages = tuning
    _mix_kernel[(h, n)](scores, stats, cache, block_table, seq_lens, cos_sin, mixed, block_table.stride(0),
                        fmt.page_bytes, scores.stride(1), cos_sin.stride(0), H=h, HP=max(16, triton.next_power_of_2(h)),
                        D=fmt.k.head_size, BLOCK=fmt.block_size, TILE=min(tile, fmt.block_size), STAGES=stages,
                        num_warps=warps, **_where_k(fmt))


def slim_decode(query: torch.Tensor, cache: torch.Tensor, fmt: KVPageFormat, block_table: torch.Tensor,
                seq_lens: torch.Tensor, sm_scale: float, max_seq_len: int, slim, out: torch.Tensor | None = None,
                scores_tuning: tuple[int, int, int] = SCORES_TUNING,
                mix_tuning: tuple[int, int, int] = MIX_TUNING) -> torch.Tensor:
    """One new token per request (``query`` [N, H, D]) over K-only pages; ``slim`` is the layer's
    ``SlimLayer`` (``w_heads`` [H, H*D, D] and the RoPE table). The tunings: for benchmarks."""
    query = query.contiguous()  # may arrive as a view into the fused QKV output
    n, h, d = query.shape
    # a multiple of 16 tokens a row: one compiled variant of both kernels whatever the step's longest context
    scores = torch.empty((n, h, -(-max(max_seq_len, 1) // 16) * 16), dtype=torch.float32, device=query.device)
    stats = torch.empty((n, h, 2), dtype=torch.float32, device=query.device)
    scores_pass(query, cache, fmt, block_table, seq_lens, sm_scale, scores, stats, scores_tuning)
    mixed = torch.empty(h, n, h * d, dtype=query.dtype, device=query.device)
    mix_pass(scores, stats, cache, fmt, block_table, seq_lens, slim.rotary.cos_sin, mixed, mix_tuning)
    result = torch.bmm(mixed, slim.w_heads.to(query.dtype)).transpose(0, 1)  # [N, H, D]
    if out is None:
        return result.contiguous()
    out.copy_(result)
    return out
