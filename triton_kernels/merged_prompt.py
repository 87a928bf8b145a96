"""MiniCache's prompt chunks on the GPU: attention as ``paged_torch.attend_pair`` computes it.

A chunk's own tokens go through vLLM's FlashAttention; its history (the request's tokens before the
chunk) comes from the pair's pages as grouped rows (they share the history) continuing from that
output and log-sum-exp: the retained tokens exactly, then the merged ones through the layer decode
kernel (``merged_decode``). The pair's second layer then writes both layers' tokens (the backend).
"""

from __future__ import annotations

import torch

from vllm_kvcompress.formats.merged import MergedLayer, MergedPairFormat
from vllm_kvcompress.token_rows import TokenRows

from .decode import paged_decode
from .merged_decode import retained_attention
from .prompt import own_chunk_attention


def merged_prompt(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                  fmt: MergedPairFormat, layer: int, rows: TokenRows, scale: float, out: torch.Tensor) -> None:
    """``query`` [T, Hq, D] of the pair's layer ``layer`` and the chunks' new ``key``/``value`` [T, H, D],
    laid out by ``rows`` (``token_rows``); the attention goes to ``out`` [T, Hq, D]."""
    lse = own_chunk_attention(query, key, value, rows.query_start, rows.max_query_len, scale, out)
    if rows.max_seq_len:  # some chunk has history
        retained_attention(query, cache, fmt, layer, rows.block_table, rows.seq_lens, scale, out, lse,
                           groups=rows.groups, prior=True)
        paged_decode(query, cache, MergedLayer(fmt, layer), rows.block_table, rows.seq_lens, scale,
                     rows.max_seq_len, out=out, groups=rows.groups, prior_lse=lse)
