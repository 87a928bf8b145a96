"""MiniCache's prompt chunks on the GPU: attention as ``paged_torch.attend_pair`` computes it.

A chunk's own tokens go through vLLM's FlashAttention; its history (the request's tokens before the
chunk) comes from the pair's pages through the layer decode kernel (``MergedLayer``: merged
directions scaled by the layer's norms, retained tokens exact), as grouped rows (they share the
history) continuing from that output and log-sum-exp. The pair's second layer then writes both
layers' tokens (the backend).
"""

from __future__ import annotations

import torch

from vllm_kvcompress.formats.merged import MergedLayer, MergedPairFormat
from vllm_kvcompress.token_rows import TokenRows

from .prompt import paged_prompt


def merged_prompt(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                  fmt: MergedPairFormat, layer: int, rows: TokenRows, scale: float, out: torch.Tensor) -> None:
    """``query`` [T, Hq, D] of the pair's layer ``layer`` and the chunks' new ``key``/``value`` [T, H, D],
    laid out by ``rows`` (``token_rows``); the attention goes to ``out`` [T, Hq, D]."""
    paged_prompt(query, key, value, cache, MergedLayer(fmt, layer), rows, scale, out)
