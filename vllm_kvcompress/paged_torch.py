"""Paged write and attention in plain torch, through a page format.

This is the CPU path of the backend and the reference that GPU kernels are
tested against. ``cache`` is one layer's pages as ``[num_blocks, page_bytes]``
uint8. A request's context before its query rows is read back from the pages,
so what the model sees is exactly what the format stores. A prompt chunk (more
than one query row) attends to its own tokens with their exact new K/V, as
FlashAttention does on the GPU; a decode (one row) reads its token back from
the pages, as the decode kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import KVPageFormat
from .formats.merged import MergedPairFormat
from .slim import SlimLayer


def write_tokens(cache: torch.Tensor, fmt: KVPageFormat, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Store new tokens ``key``/``value`` ``[N, H, D]`` at ``slot_mapping``.

    Writes to a block append after its first ``min(offset)`` tokens: each
    touched block is decoded, extended and encoded again under the append rule
    (``MinMaxCodec.encode``): a channel keeps its statistics while new tokens
    fit its grid, else it is re-encoded so that its statistics cover all of the
    block's tokens.
    """
    keep = slot_mapping >= 0
    if not keep.any():
        return
    key, value = key[keep], value[keep]
    touched, which, offsets, filled = _touched_blocks(slot_mapping[keep], fmt.block_size)
    num_stored = torch.full_like(touched, fmt.block_size).scatter_reduce(0, which, offsets, reduce="amin")
    old = cache[touched]
    k, v = fmt.decode(old)
    k[which, offsets] = key.float()
    if v is not None:
        v[which, offsets] = value.float()
    pages = fmt.encode(k, v, filled, old, num_stored)
    if fmt.recent is not None:
        pages[:, fmt.codes_bytes:] = old[:, fmt.codes_bytes:]
        newest = offsets >= filled[which] - fmt.window_cap  # the page's last tokens: one per ring slot
        fmt.write_recent(pages, which[newest], offsets[newest], key[newest], value[newest])
    cache[touched] = pages


def _touched_blocks(slots: torch.Tensor, block_size: int):
    """For new tokens at ``slots`` (none -1): the blocks they touch, each token's index among those
    and offset in its block, and how many leading slots of each touched block hold tokens after."""
    slots = slots.long()
    blocks, offsets = slots // block_size, slots % block_size
    touched, which = torch.unique(blocks, return_inverse=True)
    filled = torch.zeros_like(touched).scatter_reduce(0, which, offsets + 1, reduce="amax")
    return touched, which, offsets, filled


def attend(query: torch.Tensor, cache: torch.Tensor, fmt: KVPageFormat, query_start_loc: list[int],
           seq_lens: list[int], block_table: torch.Tensor, scale: float,
           sliding_window: int | None = None, key: torch.Tensor | None = None,
           value: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, Hq, D]`` over each request's pages.

    Request i owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, the
    last tokens of its ``seq_lens[i]``-token context. ``key``/``value`` are
    those rows' own new K/V (needed where a request has more than one row):
    a prompt chunk attends to its own tokens through them; with a recent
    window they are also the 16-bit values of a decode's token.
    """
    out = torch.empty_like(query)
    B = fmt.block_size
    # Pages a request's queries can see: with a sliding window, vLLM has already freed older ones.
    first_block = [0 if sliding_window is None else max(0, L - (query_start_loc[i + 1] - query_start_loc[i])
                                                       - sliding_window + 1) // B
                   for i, L in enumerate(seq_lens)]
    last_block = [-(-L // B) for L in seq_lens]
    rows = [block_table[i, a:b] for i, (a, b) in enumerate(zip(first_block, last_block))]
    if not rows:
        return out
    pages = cache[torch.cat(rows).long()]
    k_all, v_all = fmt.decode(pages)
    start = 0
    for i, L in enumerate(seq_lens):
        qs, qe = query_start_loc[i], query_start_loc[i + 1]
        n = last_block[i] - first_block[i]
        first = first_block[i] * B
        k = k_all[start:start + n].flatten(0, 1)[:L - first]
        v = v_all[start:start + n].flatten(0, 1)[:L - first]
        request_pages = pages[start:start + n]
        start += n
        m = qe - qs
        if m == 0:
            continue
        own = L - m if m > 1 else L  # a prompt chunk's own tokens are exact; a decode's is read back
        if m > 1:
            k[-m:], v[-m:] = key[qs:qe].float(), value[qs:qe].float()
        q_pos = torch.arange(L - m, L, device=query.device)
        k_pos = torch.arange(first, L, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        q = query[qs:qe].float().transpose(0, 1)  # [Hq, q, D]
        if fmt.recent is None:
            o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                               scale=scale, enable_gqa=True)
        else:
            exact_k, exact_v, held = _recent_values(fmt, request_pages, first, L, key[qs:qe], value[qs:qe])
            windows = torch.tensor([fmt.window(int(p) + 1) for p in q_pos], device=query.device)
            exact = mask & held[None, :] & ((k_pos[None, :] > q_pos[:, None] - windows[:, None])
                                            | (k_pos[None, :] >= own))
            o = _attention_two_sources(q, (k, v), (exact_k, exact_v), exact, mask, scale)
        out[qs:qe] = o.transpose(0, 1).to(query.dtype)
    return out


def _recent_values(fmt: KVPageFormat, pages: torch.Tensor, first: int, L: int, new_k: torch.Tensor,
                   new_v: torch.Tensor):
    """16-bit K/V of a request's tokens ``first..L-1`` where known, and which tokens those are:
    each page's ring (its last ``window_cap`` tokens), then the query rows' own new tokens."""
    ring_k, ring_v = fmt.decode_recent(pages)
    B, cap = fmt.block_size, fmt.window_cap
    pos = torch.arange(first, L, device=pages.device)
    block, offset = (pos - first) // B, pos % B
    filled = (L - pos + offset).clamp(max=B)
    held = offset >= filled - cap
    exact_k, exact_v = ring_k[block, offset % cap], ring_v[block, offset % cap]
    m = new_k.shape[0]
    exact_k[-m:], exact_v[-m:] = new_k.float(), new_v.float()
    held[-m:] = True
    return exact_k, exact_v, held


def _attention_two_sources(q, quantized, exact, use_exact, mask, scale):
    """Attention where each (query, key) pair reads K and V either from the codes or from the 16-bit copy.
    q: [Hq, q, D]; K/V pairs [L, H, D]; use_exact, mask: [q, L]."""
    group = q.shape[0] // quantized[0].shape[1]
    kq, vq = (t.repeat_interleave(group, 1).transpose(0, 1) for t in quantized)  # [Hq, L, D]
    ke, ve = (t.repeat_interleave(group, 1).transpose(0, 1) for t in exact)
    scores = torch.where(use_exact, q @ ke.transpose(1, 2), q @ kq.transpose(1, 2)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs * use_exact) @ ve + (probs * ~use_exact) @ vq


def attend_k_only(query: torch.Tensor, cache: torch.Tensor, fmt: KVPageFormat, query_start_loc: list[int],
                  seq_lens: list[int], block_table: torch.Tensor, scale: float, slim: SlimLayer,
                  key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Causal attention over K-only pages (slim attention; MHA, so ``Hq == H``).

    The query rows' own tokens use the K and V the model just computed; earlier
    tokens are scored with the K in the pages and their values come from K
    through ``slim`` (V is never built).
    """
    out = torch.empty_like(query)
    B = fmt.block_size
    for i, qs, qe, history in chunks(query_start_loc, seq_lens):
        m = qe - qs
        q = query[qs:qe].float().transpose(0, 1)  # [H, m, D]
        k_new, v_new = (t[qs:qe].float().transpose(0, 1) for t in (key, value))
        causal = torch.ones(m, m, dtype=torch.bool, device=query.device).triu(1)
        scores_new = (q @ k_new.transpose(1, 2) * scale).masked_fill(causal, float("-inf"))
        if history == 0:
            o = scores_new.softmax(-1) @ v_new
        else:
            k_hist, _ = fmt.decode(cache[block_table[i, :-(-history // B)].long()])
            k_hist = k_hist.flatten(0, 1)[:history]  # [h, H, D], after RoPE
            scores = torch.cat([q @ k_hist.permute(1, 2, 0) * scale, scores_new], dim=-1)
            probs = scores.softmax(-1)
            positions = torch.arange(history, device=query.device)
            o = slim.values_from(probs[..., :history], k_hist, positions) + probs[..., history:] @ v_new
        out[qs:qe] = o.transpose(0, 1).to(query.dtype)
    return out


def write_pair_tokens(cache: torch.Tensor, fmt: MergedPairFormat, key_a: torch.Tensor, value_a: torch.Tensor,
                      key_b: torch.Tensor, value_b: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store two layers' new tokens ``[N, H, D]`` at ``slot_mapping`` in their shared pages
    (``MergedPairFormat.append``)."""
    keep = slot_mapping >= 0
    if not keep.any():
        return
    touched, which, offsets, filled = _touched_blocks(slot_mapping[keep], fmt.block_size)
    num_stored = torch.full_like(touched, fmt.block_size).scatter_reduce(0, which, offsets, reduce="amin")
    cache[touched] = fmt.append(cache[touched], which, offsets, filled, num_stored,
                                *(t[keep] for t in (key_a, value_a, key_b, value_b)))


def attend_pair(query: torch.Tensor, cache: torch.Tensor, fmt: MergedPairFormat, layer: int,
                query_start_loc: list[int], seq_lens: list[int], block_table: torch.Tensor, scale: float,
                key: torch.Tensor, value: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of one layer of a merged pair: earlier tokens restored from the shared pages
    for ``layer``, the query rows' own tokens from their new ``key``/``value`` (the pair's pages
    take them only once both layers have run); with a sliding window, keys p - window < j <= p."""
    out = torch.empty_like(query)
    B = fmt.block_size
    for i, qs, qe, history in chunks(query_start_loc, seq_lens):
        L = seq_lens[i]
        # with a sliding window, vLLM has freed the pages before the first one the chunk sees
        first = 0 if sliding_window is None else max(0, history - sliding_window + 1) // B * B
        k, v = key[qs:qe].float(), value[qs:qe].float()
        if history > first:
            k_old, v_old = fmt.decode(cache[block_table[i, first // B:-(-history // B)].long()], layer)
            k = torch.cat([k_old.flatten(0, 1)[:history - first], k])
            v = torch.cat([v_old.flatten(0, 1)[:history - first], v])
        q_pos = torch.arange(history, L, device=query.device)
        k_pos = torch.arange(first, L, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        o = F.scaled_dot_product_attention(query[qs:qe].float().transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True)
        out[qs:qe] = o.transpose(0, 1).to(query.dtype)
    return out


def chunks(query_start_loc: list[int], seq_lens: list[int]):
    """(request, first query row, end, tokens before its chunk) of each request with query rows."""
    for i, L in enumerate(seq_lens):
        qs, qe = query_start_loc[i], query_start_loc[i + 1]
        if qe > qs:
            yield i, qs, qe, L - (qe - qs)
