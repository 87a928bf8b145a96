"""ZipCache's prompt chunks on the GPU: attention as ``prompt.paged_prompt`` computes it, then the write.

A chunk's own tokens go through vLLM's FlashAttention; its history (the request's tokens before the
chunk) is read from the mixed-precision pages by the decode kernel (``decode.paged_decode`` over a
``SalientTokensFormat``), a group of the chunk's tokens a program, which continues from
FlashAttention's output and leaves the merged log-sum-exp. That log-sum-exp turns the probe rows'
logits over the touched blocks into their attention probabilities over the whole context: the
probes cost no pass of their own over the history. ``salient_write.write_chunks`` then
re-compresses every touched block of the step at once.
"""

from __future__ import annotations

import torch

from vllm_kvcompress.config import SalientSpec
from vllm_kvcompress.formats.salient import SalientTokensFormat
from vllm_kvcompress.salient_torch import ChunkWrites
from vllm_kvcompress.token_rows import TokenRows

from .decode import paged_decode
from .prompt import own_chunk_attention
from .salient_write import write_chunks


def salient_prompt(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                   fmt: SalientTokensFormat, spec: SalientSpec, rows: TokenRows, writes: ChunkWrites | None,
                   scale: float, out: torch.Tensor, window: int | None = None) -> None:
    """``query`` [T, Hq, D] and the chunks' new ``key``/``value`` [T, H, D], laid out by ``rows``
    (``token_rows``); the attention goes to ``out`` [T, Hq, D], then the chunks' tokens into the
    pages as ``writes`` (``salient_torch.plan_chunk_writes``) places them. ``window``: the layer's
    sliding window (token p sees keys p - window < j <= p; as a probe too)."""
    lse = own_chunk_attention(query, key, value, rows.query_start, rows.max_query_len, scale, out, window)
    if rows.max_seq_len:  # some chunk has history
        windowed = {} if window is None else dict(window=window, first_keys=rows.first_keys(window))
        paged_decode(query, cache, fmt, rows.block_table, rows.seq_lens, scale, rows.max_seq_len, out=out,
                     groups=rows.groups, prior_lse=lse, lse_out=True, **windowed)
    write_chunks(query, key, value, cache, fmt, spec, writes, lse.t(), scale, window=window)  # lse: [Hq, T]
