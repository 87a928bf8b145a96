"""Attention over MiniCache's pages (``formats.merged``) for one layer of a pair, in two passes.

The layer decode kernel (``decode.paged_decode``) reads the merged directions where a layer page
keeps its codes and scales each token's logit and probability by the layer's norm
(``MergedLayer``), leaving out the retained tokens (their norms are stored negated). Those are
attended exactly here first, from their slots, by ``_retained_kernel``, together with what the
pages do not hold yet (a decode row's own new token: the pair's pages take the step's tokens after
both layers' attention), or after what the caller has attended already (a prompt chunk's own
tokens, through FlashAttention). The decode kernel then continues from this output and its
log-sum-exp (``prior_lse``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats.merged import MergedLayer, MergedPairFormat
from vllm_kvcompress.token_rows import TokenGroups

from .decode import _LOG2E, paged_decode, rows_per_program
from .decode import warm_up as warm_up_layer
from .history_rows import online_softmax_step, program_rows, store_rows
from .launch import Variant, launch


@triton.jit(do_not_specialize=["lse_head_stride"])  # the step's row count: no compile in the middle of serving
def _retained_kernel(q_ptr, key_ptr, value_ptr, pages_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr, group_rows_ptr,
                     group_starts_ptr, scale, q_row_stride, q_head_stride, key_row_stride, value_row_stride,
                     table_stride, out_row_stride, out_head_stride, lse_head_stride, PAGE: tl.constexpr,
                     B: tl.constexpr, H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, MP: tl.constexpr,
                     GROUPED: tl.constexpr, LAYER: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
                     INDEX: tl.constexpr, KEPT: tl.constexpr, OWN: tl.constexpr, PRIOR: tl.constexpr):
    """Rows of KV head program_id(1) (``program_rows``) over the retained tokens of their history's
    blocks, exact, from the slots [R, 2 layers, 2 (K, V), H, D]; OWN: and over their own new token
    (one decode row a program; ``key``/``value`` rows, heads D apart). PRIOR: ``out`` holds each
    row's attention over other tokens, its natural log-sum-exp at ``lse`` [query head, row]; the
    rows end up with the attention over both. Writes the output and log-sum-exp there."""
    row, length, token, head, live, q = program_rows(q_ptr, lens_ptr, group_rows_ptr, group_starts_ptr, scale,
                                                     q_row_stride, q_head_stride, G, MP, D, GROUPED)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.zeros([MP], tl.float32)
    acc = tl.zeros([MP, D], tl.float32)
    r = tl.arange(0, RP)
    raw = tl.pointer_type(q_ptr.dtype.element_ty)
    if R > 0:
        for start in range(0, length, B):
            page = pages_ptr + tl.load(table_ptr + row * table_stride + start // B).to(tl.int64) * PAGE
            kept_at = tl.load((page + INDEX).to(tl.pointer_type(tl.int16)) + r, mask=r < R, other=-1).to(tl.int32)
            valid = (kept_at >= 0) & (start + kept_at < length)
            kept = (page + KEPT).to(raw) + ((r[:, None] * 2 + LAYER) * 2 * H + h) * D + d[None, :]
            k = tl.load(kept, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(kept + H * D, mask=valid[:, None], other=0.0).to(tl.float32)
            m_i, l_i, acc = online_softmax_step(q, k, v, valid, m_i, l_i, acc)
    if OWN:  # the row's new token, as the first of 16 rows of the products
        first = r < 1
        at = h * D + d[None, :] + r[:, None] * 0
        k = tl.load(key_ptr + row * key_row_stride + at, mask=first[:, None], other=0.0).to(tl.float32)
        v = tl.load(value_ptr + row * value_row_stride + at, mask=first[:, None], other=0.0).to(tl.float32)
        m_i, l_i, acc = online_softmax_step(q, k, v, first, m_i, l_i, acc)
    lse_at = lse_ptr + head * lse_head_stride + token
    if PRIOR:  # both parts' sums, relative to the larger of their maxima (base 2)
        prior = tl.load(lse_at, mask=live, other=float("-inf")) * _LOG2E
        top = tl.maximum(m_i, prior)
        top = tl.where(top == float("-inf"), 0.0, top)
        alpha = tl.exp2(m_i - top)
        beta = tl.exp2(prior - top)
        before = tl.load(out_ptr + token[:, None] * out_row_stride + head[:, None] * out_head_stride + d[None, :],
                         mask=live[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + before * beta[:, None]
        l_i = l_i * alpha + beta
        m_i = top
    store_rows(out_ptr, lse_ptr, acc, m_i, l_i, token, head, live, out_row_stride, out_head_stride, 1,
               lse_head_stride, D)


@functools.cache  # one Variant a configuration: launch keeps its compiled kernel by it
def retained_variant(fmt: MergedPairFormat, layer: int, group: int, rows: int, grouped: bool, own: bool,
                     prior: bool) -> Variant:
    """``_retained_kernel`` for ``layer`` of ``fmt``'s pairs, ``group`` query heads a KV head and
    ``rows`` tokens a program."""
    at = fmt.regions.start
    return Variant(_retained_kernel, dict(
        PAGE=fmt.page_bytes, B=fmt.block_size, H=fmt.k.num_heads, D=fmt.k.head_size, G=group,
        MP=max(16, triton.next_power_of_2(rows * group)), GROUPED=grouped, LAYER=layer, R=fmt.retained,
        RP=max(16, triton.next_power_of_2(fmt.retained)), INDEX=at("index"), KEPT=at("kept"), OWN=own, PRIOR=prior),
        {"num_warps": 4})


def retained_attention(q: torch.Tensor, pages: torch.Tensor, fmt: MergedPairFormat, layer: int,
                       block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                       lse: torch.Tensor, own: tuple[torch.Tensor, torch.Tensor] | None = None,
                       groups: TokenGroups | None = None, prior: bool = False) -> None:
    """Rows ``q`` [N, Hq, D] of the pair's layer ``layer`` over the retained tokens of their first
    ``seq_lens`` tokens (``own``: and their new ``key``, ``value`` [N, H, D]; ``prior``: after what
    ``out`` holds, of log-sum-exp ``lse``) into ``out`` and ``lse`` [Hq, N] (natural)."""
    n, hq, d = q.shape
    if n == 0:
        return
    if q.dtype != fmt.dtype:
        raise ValueError(f"queries in {q.dtype}, pages of {fmt.dtype}: the kernel reads slots as the queries' dtype")
    if lse.stride(1) != 1 or (own is not None and any(x.stride(1) != d or x.stride(2) != 1 for x in own)):
        raise ValueError("lse: rows contiguous; key, value: heads and channels contiguous within a row")
    heads = fmt.k.num_heads
    key, value = own if own is not None else (q, q)  # q: a pointer the kernel never reads
    rows, starts = (seq_lens, seq_lens) if groups is None else (groups.rows, groups.starts)
    variant = retained_variant(fmt, layer, hq // heads, 1 if groups is None else groups.size, groups is not None,
                               own is not None, prior)
    launch(variant, (n if groups is None else groups.starts.shape[0], heads),
           (q, key, value, pages, block_table, seq_lens, out, lse, rows, starts, scale, q.stride(0), q.stride(1),
            key.stride(0), value.stride(0), block_table.stride(0), out.stride(0), out.stride(1), lse.stride(0)))


def decode_rows(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor, fmt: MergedPairFormat,
                layer: int, block_table: torch.Tensor, history: torch.Tensor, scale: float, longest: int,
                out: torch.Tensor, row_order: torch.Tensor | None = None) -> None:
    """Decode rows (one new token each, ``q`` [N, Hq, D], ``key``/``value`` [N, H, D]) as
    ``paged_torch.attend_pair`` computes them: the ``history`` tokens before the new one (at most
    ``longest``) from the pages, the new token's own exact term beside them."""
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    retained_attention(q, pages, fmt, layer, block_table, history, scale, out, lse, own=(key, value))
    paged_decode(q, pages, MergedLayer(fmt, layer), block_table, history, scale, longest, out=out,
                 row_order=row_order, prior_lse=lse)


def warm_up(cache: torch.Tensor, fmt: MergedPairFormat, num_query_heads: int, query_dtype: torch.dtype) -> None:
    """Compile what a serving step may launch for both layers of ``fmt``'s pairs: the layer decode
    kernel's variants (``decode.warm_up``) and the retained pass's, for decode rows and for groups of
    prompt rows. Launches one row over page 0; outputs are discarded."""
    dev = cache.device
    heads, d = fmt.k.num_heads, fmt.k.head_size
    q = torch.zeros(1, num_query_heads, d, dtype=query_dtype, device=dev)
    new = torch.zeros(1, heads, d, dtype=query_dtype, device=dev)
    table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    lens = torch.ones(1, dtype=torch.int32, device=dev)
    group = TokenGroups(lens, torch.zeros(1, dtype=torch.int32, device=dev),
                        rows_per_program(num_query_heads // heads))
    for layer in (0, 1):
        warm_up_layer(cache, MergedLayer(fmt, layer), num_query_heads, query_dtype)
        lse = torch.zeros(num_query_heads, 1, dtype=torch.float32, device=dev)
        retained_attention(q, cache, fmt, layer, table, lens, 1.0, torch.empty_like(q), lse, own=(new, new))
        retained_attention(q, cache, fmt, layer, table, lens, 1.0, torch.zeros_like(q), lse, groups=group, prior=True)
