"""ZipCache's prompt chunks on the GPU: attention as ``history.prompt_chunks`` computes it, then the write.

A step whose chunks have history and enough query rows for it (``history.decodes_ahead``) decodes
the history once into 16-bit rows and runs one FlashAttention call over it and the chunks' own
tokens (``history.dense_prompt``); otherwise the chunks' own tokens go through FlashAttention and
their history is read from the mixed-precision pages by the decode kernel (``prompt.paged_attention``
over a ``SalientTokensFormat``), a group of the chunk's tokens a program, which continues from
FlashAttention's output. Either leaves each row's log-sum-exp over its whole context, which turns
the probe rows' logits over the touched blocks into their attention probabilities: the probes cost
no pass of their own over the history. ``salient_write.write_chunks`` then re-compresses every
touched block of the step at once.
"""

from __future__ import annotations

import torch

from vllm_kvcompress.config import SalientSpec
from vllm_kvcompress.formats.salient import SalientTokensFormat
from vllm_kvcompress.salient_torch import ChunkWrites
from vllm_kvcompress.token_rows import TokenRows

from . import salient_decode
from .history import decodes_ahead, dense_prompt, warm_up_rows
from .prompt import paged_attention
from .salient_write import write_chunks


def salient_prompt(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                   fmt: SalientTokensFormat, spec: SalientSpec, rows: TokenRows, writes: ChunkWrites | None,
                   scale: float, out: torch.Tensor, window: int | None = None) -> None:
    """``query`` [T, Hq, D] and the chunks' new ``key``/``value`` [T, H, D], laid out by ``rows``
    (``token_rows``); the attention goes to ``out`` [T, Hq, D], then the chunks' tokens into the
    pages as ``writes`` (``salient_torch.plan_chunk_writes``) places them. ``window``: the layer's
    sliding window (token p sees keys p - window < j <= p; as a probe too)."""
    if decodes_ahead(rows, query, key):
        lse = dense_prompt(query, key, value, cache, fmt, rows, scale, out, window)
    else:
        lse = paged_attention(query, key, value, cache, fmt, rows, scale, out, window, lse_out=True)
    write_chunks(query, key, value, cache, fmt, spec, writes, lse.t(), scale, window=window)  # lse: [Hq, T]


def warm_up(cache: torch.Tensor, fmt: SalientTokensFormat, num_query_heads: int, query_dtype: torch.dtype,
            window: int | None = None) -> None:
    """Compile both routes a step may take: the decode kernel's and the write's variants
    (``salient_decode.warm_up``) and the history kernel (``history.warm_up_rows``)."""
    salient_decode.warm_up(cache, fmt, num_query_heads, query_dtype, window)
    warm_up_rows(cache, fmt, query_dtype)
