"""Attention of prompt chunks: each chunk's own tokens exactly, its request's history from the pages.

A chunk's tokens attend causally to their own fresh K/V through vLLM's FlashAttention, which also
gives each row's log-sum-exp. The decode kernel then reads the history (the request's tokens before
the chunk) from the pages, every token of a chunk a row over the same history, and continues from
FlashAttention's output and log-sum-exp (``paged_decode``'s ``prior_lse``): the two parts are merged
where the history's pass ends, with no kernel of their own and no read-back of the chunk from the
pages. A chunk with no history keeps FlashAttention's output as it is. In a sliding-window layer,
both parts see each token's window.
"""

from __future__ import annotations

import functools

import torch

from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.formats.merged import MergedLayer
from vllm_kvcompress.formats.salient import SalientTokensFormat
from vllm_kvcompress.token_rows import TokenRows

from .decode import paged_decode


def paged_prompt(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                 fmt: KVPageFormat | MergedLayer, rows: TokenRows, sm_scale: float, out: torch.Tensor,
                 window: int | None = None, **tuning) -> torch.Tensor:
    """``query`` [T, Hq, D] and the chunks' new ``key``/``value`` [T, H, D], the chunks laid out by
    ``rows`` (``token_rows``); the attention goes to ``out`` [T, Hq, D]. ``window``: the layer's
    sliding window (token p sees keys p - window < j <= p). ``tuning``: the history
    kernel's ``tile``, ``num_warps`` and ``num_stages`` where not its defaults (for benchmarks)."""
    paged_attention(query, key, value, cache, fmt, rows, sm_scale, out, window, **tuning)
    return out


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                    fmt: KVPageFormat | MergedLayer | SalientTokensFormat, rows: TokenRows, sm_scale: float,
                    out: torch.Tensor, window: int | None = None, lse_out: bool = False, **tuning) -> torch.Tensor:
    """``paged_prompt``'s attention; returns the rows' natural log-sum-exp [Hq, T]: FlashAttention's
    over each chunk's own tokens, or with ``lse_out`` over the whole context (the decode kernel
    merges the history's in; ZipCache's probes need it)."""
    lse = own_chunk_attention(query, key, value, rows.query_start, rows.max_query_len, sm_scale, out, window)
    if rows.max_seq_len:  # some chunk has history
        if window is not None:
            tuning.update(window=window, first_keys=rows.first_keys(window))
        paged_decode(query, cache, fmt, rows.block_table, rows.seq_lens, sm_scale, rows.max_seq_len, out=out,
                     groups=rows.groups, prior_lse=lse, lse_out=lse_out, **tuning)
    return lse


def own_chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start: torch.Tensor,
                        max_query_len: int, sm_scale: float, out: torch.Tensor,
                        window: int | None = None) -> torch.Tensor:
    """Each chunk's causal attention over its own tokens (with a sliding ``window``, token p over
    those after p - window) into ``out``; the rows' natural log-sum-exp [Hq, T]."""
    return chunks_attention(query, key, value, query_start, max_query_len, query_start, max_query_len, sm_scale,
                            out, window)


def chunks_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start: torch.Tensor,
                     max_query_len: int, key_start: torch.Tensor, max_key_len: int, sm_scale: float,
                     out: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Each chunk's queries (rows ``query_start``) over its keys (rows ``key_start``; the chunk's own
    tokens last: causal, aligned at the end; within a sliding ``window``) into ``out``, through vLLM's
    FlashAttention; the rows' natural log-sum-exp [Hq, T]."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
    _, lse = flash_attn_varlen_func(q=query, k=key, v=value, out=out, cu_seqlens_q=query_start,
                                    max_seqlen_q=max_query_len, cu_seqlens_k=key_start, max_seqlen_k=max_key_len,
                                    softmax_scale=sm_scale, causal=True,
                                    window_size=(-1, -1) if window is None else (window - 1, 0),
                                    return_softmax_lse=True, fa_version=flash_attention_version(query.shape[-1]))
    return lse


@functools.cache
def flash_attention_version(head_size: int) -> int | None:
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    return get_flash_attn_version(head_size=head_size)


def flash_attention_available() -> bool:
    """Whether this vLLM build has its FlashAttention (on CUDA: ``vllm.vllm_flash_attn``)."""
    from vllm.v1.attention.backends.fa_utils import is_flash_attn_varlen_func_available
    return is_flash_attn_varlen_func_available()
