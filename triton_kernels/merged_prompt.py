"""MiniCache's prompt chunks on the GPU: attention as ``paged_torch.attend_pair`` computes it.

A chunk's own tokens go through vLLM's FlashAttention; its history (the request's tokens before the
chunk) is restored from the pair's pages by ``merged_decode``, one program per group of the chunk's
tokens (they share the history). The two parts are merged by their log-sum-exp. The pair's second
layer then writes both layers' tokens (the backend).
"""

from __future__ import annotations

import torch

from vllm_kvcompress.formats.merged import MergedPairFormat
from vllm_kvcompress.token_rows import TokenRows

from .merged_decode import merged_decode
from .prompt import merge_history, own_chunk_attention


def merged_prompt(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                  fmt: MergedPairFormat, layer: int, rows: TokenRows, scale: float, out: torch.Tensor) -> None:
    """``query`` [T, Hq, D] of the pair's layer ``layer`` and the chunks' new ``key``/``value`` [T, H, D],
    laid out by ``rows`` (``token_rows``); the attention goes to ``out`` [T, Hq, D]."""
    lse = own_chunk_attention(query, key, value, rows.query_start, rows.max_query_len, scale, out).transpose(0, 1)
    if rows.max_seq_len:  # some chunk has history
        earlier, earlier_lse = merged_decode(query, cache, fmt, layer, rows.block_table, rows.seq_lens, scale,
                                             groups=rows.groups)
        merge_history(out, lse, earlier, earlier_lse)
