"""A decode row's attention over its own new token alone, the start of an attention that a decode
kernel continues over the pages (``paged_decode``'s ``prior_lse``) where the pages take the step's
tokens only after attention (MiniCache's pairs, ZipCache's choice of 4-bit tokens)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import Variant, launch


@triton.jit(do_not_specialize=["lse_head_stride"])  # the step's row count: no compile in the middle of serving
def _own_token_kernel(q_ptr, key_ptr, value_ptr, out_ptr, lse_ptr, scale, q_row_stride, key_row_stride,
                      value_row_stride, out_row_stride, lse_head_stride, D: tl.constexpr, G: tl.constexpr,
                      GP: tl.constexpr):
    """Decode row program_id(0), the G query heads of KV head program_id(1), over its own new token
    alone: the output is the token's V, the log-sum-exp its logit (natural), at ``lse`` [query head,
    row]. Heads and channels contiguous within a row."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = tl.arange(0, GP)
    live = g < G
    head = h * G + g
    d = tl.arange(0, D)
    q = tl.load(q_ptr + row * q_row_stride + head[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    k = tl.load(key_ptr + row * key_row_stride + h * D + d)
    v = tl.load(value_ptr + row * value_row_stride + h * D + d)
    logit = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * scale
    tl.store(lse_ptr + head * lse_head_stride + row, logit, mask=live)
    tl.store(out_ptr + row * out_row_stride + head[:, None] * D + d[None, :], tl.broadcast_to(v[None, :], (GP, D)),
             mask=live[:, None])


@functools.cache  # one Variant a shape: launch keeps its compiled kernel by it
def _own_token_variant(head_size: int, group: int) -> Variant:
    return Variant(_own_token_kernel, dict(D=head_size, G=group, GP=triton.next_power_of_2(group)), {"num_warps": 1})


def own_token(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """Each row of ``q`` [N, Hq, D] over its own ``key``/``value`` [N, H, D] into ``out``; returns the
    natural log-sum-exp [Hq, N] (float32). Heads and channels contiguous within a row."""
    n, hq, d = q.shape
    if any(x.stride(1) != d or x.stride(2) != 1 for x in (q, key, value, out)):
        raise ValueError("q, key, value, out: heads and channels contiguous within a row")
    lse = torch.empty(hq, n, dtype=torch.float32, device=q.device)
    launch(_own_token_variant(d, hq // key.shape[1]), (n, key.shape[1]),
           (q, key, value, out, lse, scale, q.stride(0), key.stride(0), value.stride(0), out.stride(0), lse.stride(0)))
    return lse
