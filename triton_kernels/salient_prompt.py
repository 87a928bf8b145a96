"""ZipCache's prompt chunks on the GPU: attention as ``prompt.paged_prompt`` computes it, then the write.

A chunk's own tokens go through vLLM's FlashAttention; its history (the request's tokens before the
chunk) is read from the mixed-precision pages by ``salient_decode``, one program per group of the
chunk's tokens (they share the history). The two parts are merged by their log-sum-exp, and that
merged log-sum-exp turns the probe rows' logits over the touched blocks into their attention
probabilities over the whole context: the probes cost no pass of their own over the history.
``salient_write.write_chunks`` then re-compresses every touched block of the step at once.
"""

from __future__ import annotations

import torch

from vllm_kvcompress.config import SalientSpec
from vllm_kvcompress.formats.salient import SalientTokensFormat
from vllm_kvcompress.token_rows import TokenRows

from .prompt import merge_history, own_chunk_attention
from .salient_decode import salient_decode
from .salient_write import write_chunks


def salient_prompt(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                   fmt: SalientTokensFormat, spec: SalientSpec, rows: TokenRows, query_start_loc: list[int],
                   seq_lens: list[int], block_table: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """``query`` [T, Hq, D] and the chunks' new ``key``/``value`` [T, H, D], laid out by ``rows``
    (``token_rows``) and, on the host, by ``query_start_loc`` (from 0) and ``seq_lens``; the attention
    goes to ``out`` [T, Hq, D], then the chunks' tokens into the pages."""
    lse = own_chunk_attention(query, key, value, rows.query_start, rows.max_query_len, scale, out).transpose(0, 1)
    if rows.max_seq_len:  # some chunk has history
        earlier, earlier_lse = salient_decode(query, cache, fmt, rows.block_table, rows.seq_lens, scale,
                                              groups=rows.groups)
        lse = merge_history(out, lse, earlier, earlier_lse)
    write_chunks(query, key, value, cache, fmt, spec, query_start_loc, seq_lens, block_table, lse, scale)
