"""Decode attention over K-only pages (slim attention, MHA, 16-bit K).

Head h's output is ``(softmax(q_h K_h^T) K_pre) W_KV[:, h]``, where the weighted
sum runs over *all* heads' K (rotated back to before RoPE). Two passes, each
reading the pages once:

1. ``_scores_kernel``, one program per (request, head): the scores ``q_h . K_h`` and their
   softmax statistics (max, sum of exponentials), computed as it goes.
2. ``_mix_kernel``, one program per (request, K head c): ``P [H, T] @ RoPE^-1(K_c) [T, D]``,
   with ``P`` made from the scores and statistics on the fly,
   the columns ``c*D .. c*D+D`` of every head's weighted sum, as tensor-core dots.

A batched product with ``W_KV`` per head finishes it. Neither V nor a
full-precision copy of K is ever written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats import KVPageFormat


@triton.jit
def _scores_kernel(q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, s_ptr, stats_ptr, sm_scale, bt_stride, page_bytes,
                   s_stride, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Scores of one (request, head), and their softmax statistics: max and sum of exp(s - max)."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    dtype = q_ptr.dtype.element_ty
    L = tl.load(seq_lens_ptr + seq)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (seq * H + h) * D + d).to(tl.float32)
    m = tl.full([TILE], float("-inf"), tl.float32)  # running per lane, combined at the end
    l = tl.zeros([TILE], tl.float32)
    for b in range(0, tl.cdiv(L, BLOCK)):
        page = cache_ptr + tl.load(block_table_ptr + seq * bt_stride + b).to(tl.int64) * page_bytes
        for t0 in range(0, BLOCK, TILE):
            tok = t0 + tl.arange(0, TILE)
            pos = b * BLOCK + tok
            valid = pos < L
            k = tl.load(page.to(tl.pointer_type(dtype)) + (tok[:, None] * H + h) * D + d[None, :],
                        mask=valid[:, None], other=0.0).to(tl.float32)
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
                TILE: tl.constexpr):
    """Probabilities ``exp(s - max) / sum`` from the first pass's scores and statistics; NeoX
    rotation over the whole head: ``pre = (k1 cos + k2 sin, k2 cos - k1 sin)`` on the halves."""
    seq = tl.program_id(0)
    c = tl.program_id(1)
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
    for b in range(0, tl.cdiv(L, BLOCK)):
        page = cache_ptr + tl.load(block_table_ptr + seq * bt_stride + b).to(tl.int64) * page_bytes
        for t0 in range(0, BLOCK, TILE):
            tok = t0 + tl.arange(0, TILE)
            pos = b * BLOCK + tok
            valid = pos < L
            both = hmask[:, None] & valid[None, :]
            s = tl.load(s_ptr + (seq * H + heads[:, None]) * p_stride + pos[None, :], mask=both, other=0.0)
            p = tl.where(both, tl.exp(s - m) * inv_l, 0.0)
            k_row = page.to(tl.pointer_type(dtype)) + (tok[:, None] * H + c) * D
            k1 = tl.load(k_row + dh[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            k2 = tl.load(k_row + HALF + dh[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            cs = cos_sin_ptr + pos[:, None] * cs_stride + dh[None, :]
            cos = tl.load(cs, mask=valid[:, None], other=0.0)
            sin = tl.load(cs + HALF, mask=valid[:, None], other=0.0)
            pf = p.to(tl.float16)
            acc1 += tl.dot(pf, (k1 * cos + k2 * sin).to(tl.float16))
            acc2 += tl.dot(pf, (k2 * cos - k1 * sin).to(tl.float16))
    dst = out_ptr + (seq * H + heads[:, None]) * (H * D) + c * D + dh[None, :]
    tl.store(dst, acc1.to(dtype), mask=hmask[:, None])
    tl.store(dst + HALF, acc2.to(dtype), mask=hmask[:, None])


def slim_decode(query: torch.Tensor, cache: torch.Tensor, fmt: KVPageFormat, block_table: torch.Tensor,
                seq_lens: torch.Tensor, sm_scale: float, max_seq_len: int, slim, out: torch.Tensor | None = None,
                tile: int = 32) -> torch.Tensor:
    """One new token per request (``query`` [N, H, D]) over K-only pages; ``slim`` is the layer's
    ``SlimLayer`` (``w_heads`` [H, H*D, D] and the RoPE table)."""
    query = query.contiguous()  # may arrive as a view into the fused QKV output
    n, h, d = query.shape
    block = fmt.block_size
    tile = min(tile, block)
    scores = torch.empty((n, h, max_seq_len), dtype=torch.float32, device=query.device)
    stats = torch.empty((n, h, 2), dtype=torch.float32, device=query.device)
    _scores_kernel[(n, h)](query, cache, block_table, seq_lens, scores, stats, sm_scale, block_table.stride(0),
                           fmt.page_bytes, scores.stride(1), H=h, D=d, BLOCK=block, TILE=tile)
    mixed = torch.empty(n, h, h * d, dtype=query.dtype, device=query.device)
    cos_sin = slim.rotary.cos_sin.float()
    _mix_kernel[(n, h)](scores, stats, cache, block_table, seq_lens, cos_sin, mixed, block_table.stride(0),
                        fmt.page_bytes, scores.stride(1), cos_sin.stride(0), H=h, HP=max(16, triton.next_power_of_2(h)),
                        D=d, BLOCK=block, TILE=tile)
    result = torch.bmm(mixed.transpose(0, 1), slim.w_heads.to(query.dtype)).transpose(0, 1)  # [N, H, D]
    if out is None:
        return result
    out.copy_(result)
    return out
