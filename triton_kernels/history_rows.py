"""The query rows of a history kernel's program, and its output: shared by the kernels that read
their own page formats (``salient_decode``).

A program takes the G query heads of one KV head, of one decode token or of each token of a group
of a prompt chunk's tokens (``token_rows``), which share one history and one block-table row. It
writes its rows' attention over that history and their log-sum-exp (base e), which the caller
merges with what the pages do not hold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import _LOG2E


@triton.jit
def program_rows(q_ptr, lens_ptr, group_rows_ptr, group_starts_ptr, scale, q_row_stride, q_head_stride,
                 G: tl.constexpr, MP: tl.constexpr, D: tl.constexpr, GROUPED: tl.constexpr):
    """(the program's first token ``row``, its history's length, each of the MP rows' token and query
    head, which rows are live, the rows' queries [MP, D] scaled to base 2) for KV head program_id(1)."""
    h = tl.program_id(1)
    if GROUPED:
        row = tl.load(group_starts_ptr + tl.program_id(0))
        count = tl.load(group_rows_ptr + row)
    else:
        row = tl.program_id(0)
        count = 1
    g = tl.arange(0, MP)
    token = row + g // G
    head = h * G + g % G
    live = g < count * G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + token[:, None] * q_row_stride + head[:, None] * q_head_stride + d[None, :],
                mask=live[:, None], other=0.0).to(tl.float32) * (scale * _LOG2E)
    return row, tl.load(lens_ptr + row), token, head, live, q


@triton.jit
def online_softmax_step(q, k, v, valid, m_i, l_i, acc):
    """One online-softmax step of rows ``q`` [MP, D] (scaled to base 2) over tokens ``k``, ``v``
    [T, D] (``valid`` [T]); a step may have no valid token."""
    s = tl.where(valid[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v)


@triton.jit
def store_rows(out_ptr, lse_ptr, acc, m_i, l_i, token, head, live, out_row_stride, out_head_stride, lse_row_stride,
               D: tl.constexpr):
    """The rows' output (acc over l_i) and log-sum-exp (from base-2 m_i, l_i); a row of no history
    gets 0 and -inf."""
    d = tl.arange(0, D)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * out_row_stride + head[:, None] * out_head_stride + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=live[:, None])
    tl.store(lse_ptr + token * lse_row_stride + head, (m_i + tl.log2(l_i)) / _LOG2E, mask=live)


def history_outputs(q: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What a history kernel writes for rows ``q`` [N, Hq, D]: the output (``out``, or a new tensor
    like ``q``) and the log-sum-exp [N, Hq] float32."""
    out = torch.empty_like(q) if out is None else out
    return out, torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
