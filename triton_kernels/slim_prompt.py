"""Attention of prompt chunks over K-only pages (slim attention).

A chunk's own tokens have the K and V the model just computed. Where no chunk of the step has
history (the common case), vLLM's FlashAttention takes them as they are. Where some have, each
such chunk's history is read from the pages and its V rebuilt as a matrix product,
``V = RoPE^-1(K) W_KV`` (``SlimLayer.values``), and FlashAttention runs every chunk over its
history followed by its own tokens (causal, aligned at the end). Rebuilding V once for the
chunk costs ``2 (H D)^2`` a history token, less than the decode route's ``2 H^2 D`` a token and
query row once a chunk has more than ``D`` rows, and FlashAttention then does the rest at full
speed; the rebuilt V lives only for the call.
"""

from __future__ import annotations

import torch

from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.paged_torch import chunks
from vllm_kvcompress.token_rows import TokenRows

from .prompt import chunks_attention, own_chunk_attention


def slim_prompt(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                fmt: KVPageFormat, rows: TokenRows, query_start_loc: list[int], seq_lens: list[int],
                block_table: torch.Tensor, sm_scale: float, slim, out: torch.Tensor) -> torch.Tensor:
    """``query`` [T, H, D] and the chunks' new ``key``/``value`` [T, H, D], laid out by ``rows``;
    ``query_start_loc`` [R+1] and ``seq_lens`` [R]: the chunks' offsets in the step (the first at
    ``query``'s row 0) and their requests' lengths, from the host; ``block_table`` [R, max_blocks];
    ``slim``: the layer's ``SlimLayer``. The attention goes to ``out`` [T, H, D]."""
    if not rows.max_seq_len:  # no chunk has history
        own_chunk_attention(query, key, value, rows.query_start, rows.max_query_len, sm_scale, out)
        return out
    keys, values, key_lens = [], [], []
    for i, qs, qe, history in chunks([x - query_start_loc[0] for x in query_start_loc], seq_lens):
        if history:
            k_hist, v_hist = history_kv(cache, fmt, block_table[i], history, slim, query.dtype)
            keys.append(k_hist)
            values.append(v_hist)
        keys.append(key[qs:qe])
        values.append(value[qs:qe])
        key_lens.append(history + qe - qs)
    starts = torch.tensor([0] + key_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(query.device)
    chunks_attention(query, torch.cat(keys), torch.cat(values), rows.query_start, rows.max_query_len, starts,
                     max(key_lens), sm_scale, out)
    return out


# Tokens of history decoded and given their V at a time: the float32 intermediates of a piece (about
# 16 KB a token at 32 heads of 128) stay near 100 MB however long the history.
HISTORY_PIECE = 2048


def history_kv(cache: torch.Tensor, fmt: KVPageFormat, block_table_row: torch.Tensor, history: int, slim,
               dtype: torch.dtype, piece: int = HISTORY_PIECE) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's first ``history`` tokens from its K-only pages: K as the pages give it back and V =
    RoPE^-1(K) W_KV, both [history, H, D] in ``dtype``, built ``piece`` tokens (whole pages) at a time."""
    step = max(piece // fmt.block_size, 1) * fmt.block_size
    k = torch.empty(history, fmt.k.num_heads, fmt.k.head_size, dtype=dtype, device=cache.device)
    v = torch.empty_like(k)
    for start in range(0, history, step):
        end = min(start + step, history)
        blocks = block_table_row[start // fmt.block_size: -(-end // fmt.block_size)].long()
        k[start:end] = fmt.decode(cache[blocks])[0].flatten(0, 1)[:end - start]
        v[start:end] = slim.values(k[start:end], torch.arange(start, end, device=cache.device), dtype)
    return k, v
