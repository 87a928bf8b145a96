"""Decode rows over MiniCache's pages (``formats.merged``) for one layer of a pair.

The layer decode kernel (``decode.paged_decode`` over a ``MergedLayer``) reads the history: the
merged directions where a layer page keeps its codes, each token's logit and probability scaled by
the layer's norms, the retained tokens (norms stored negated) left out of their tiles and attended
exactly from their slots after the tiles, a block at a time. What the pages do not hold yet, a
decode row's own new token (the pair's pages take the step's tokens after both layers' attention),
is attended first by ``_own_token_kernel``; the decode kernel continues from its output and
log-sum-exp (``prior_lse``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats.merged import MergedLayer, MergedPairFormat

from .decode import paged_decode
from .decode import warm_up as warm_up_layer
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


def decode_rows(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor, fmt: MergedPairFormat,
                layer: int, block_table: torch.Tensor, history: torch.Tensor, scale: float, longest: int,
                out: torch.Tensor, row_order: torch.Tensor | None = None) -> None:
    """Decode rows (one new token each, ``q`` [N, Hq, D], ``key``/``value`` [N, H, D]) as
    ``paged_torch.attend_pair`` computes them: the ``history`` tokens before the new one (at most
    ``longest``) from the pages, the new token's own exact term beside them. ``q``, ``key``,
    ``value`` and ``out``: heads and channels contiguous within a row."""
    n, hq, d = q.shape
    if n == 0:
        return
    if any(x.stride(1) != d or x.stride(2) != 1 for x in (q, key, value, out)):
        raise ValueError("q, key, value, out: heads and channels contiguous within a row")
    lse = torch.empty(hq, n, dtype=torch.float32, device=q.device)
    launch(_own_token_variant(d, hq // key.shape[1]), (n, key.shape[1]),
           (q, key, value, out, lse, scale, q.stride(0), key.stride(0), value.stride(0), out.stride(0), lse.stride(0)))
    paged_decode(q, pages, MergedLayer(fmt, layer), block_table, history, scale, longest, out=out,
                 row_order=row_order, prior_lse=lse)


def warm_up(cache: torch.Tensor, fmt: MergedPairFormat, num_query_heads: int, query_dtype: torch.dtype) -> None:
    """Compile what a serving step may launch for both layers of ``fmt``'s pairs: the layer decode
    kernel's variants (``decode.warm_up``) and the own-token kernel. Launches one row over page 0;
    outputs are discarded."""
    heads, d = fmt.k.num_heads, fmt.k.head_size
    q = torch.zeros(1, num_query_heads, d, dtype=query_dtype, device=cache.device)
    new = torch.zeros(1, heads, d, dtype=query_dtype, device=cache.device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=cache.device)
    for layer in (0, 1):
        warm_up_layer(cache, MergedLayer(fmt, layer), num_query_heads, query_dtype)
        decode_rows(q, new, new, cache, fmt, layer, table, torch.zeros(1, dtype=torch.int32, device=cache.device),
                    1.0, 1, torch.empty_like(q))
