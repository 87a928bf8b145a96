"""Attention of prompt chunks over K-only pages (slim attention).

A chunk's own tokens have the K and V the model just computed. Where no chunk of the step has
history (the common case), vLLM's FlashAttention takes them as they are. Where some have, each
such chunk's history is read from the pages and its V rebuilt in one matrix product,
``V = RoPE^-1(K) W_KV`` (``SlimLayer.values``), and FlashAttention runs every chunk over its
history followed by its own tokens (causal, aligned at the end). Rebuilding V once for the
chunk costs ``2 (H D)^2`` a history token, less than the decode route's ``2 H^2 D`` a token and
query row once a chunk has more than ``D`` rows, and FlashAttention then does the rest at full
speed; the rebuilt V lives only for the call.
"""

from __future__ import annotations

import torch

from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.token_rows import TokenRows

from .prompt import flash_attention_version, own_chunk_attention


def slim_prompt(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                fmt: KVPageFormat, rows: TokenRows, chunks: list[tuple[int, int, int, int]],
                block_table: torch.Tensor, sm_scale: float, slim, out: torch.Tensor) -> torch.Tensor:
    """``query`` [T, H, D] and the chunks' new ``key``/``value`` [T, H, D], laid out by ``rows``;
    ``chunks``: (request, first row, end, history) of each chunk, from the host; ``block_table``
    [R, max_blocks]; ``slim``: the layer's ``SlimLayer``. The attention goes to ``out`` [T, H, D]."""
    if not rows.max_seq_len:  # no chunk has history
        own_chunk_attention(query, key, value, rows.query_start, rows.max_query_len, sm_scale, out)
        return out
    keys, values, key_lens = [], [], []
    for i, qs, qe, history in chunks:
        if history:
            blocks = block_table[i, :-(-history // fmt.block_size)].long()
            k_hist = fmt.decode(cache[blocks])[0].flatten(0, 1)[:history].to(query.dtype)  # [history, H, D]
            positions = torch.arange(history, device=query.device)
            keys.append(k_hist)
            values.append(slim.values(k_hist, positions, query.dtype))
        keys.append(key[qs:qe])
        values.append(value[qs:qe])
        key_lens.append(history + qe - qs)
    starts = torch.tensor([0] + key_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(query.device)
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
    flash_attn_varlen_func(q=query, k=torch.cat(keys), v=torch.cat(values), out=out, cu_seqlens_q=rows.query_start,
                           max_seqlen_q=rows.max_query_len, cu_seqlens_k=starts, max_seqlen_k=max(key_lens),
                           softmax_scale=sm_scale, causal=True, fa_version=flash_attention_version(query.shape[-1]))
    return out
