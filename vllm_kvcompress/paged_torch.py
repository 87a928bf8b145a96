"""Paged write and attention in plain torch, through a page format.

This is the CPU path of the backend and the reference that GPU kernels are
tested against. ``cache`` is one layer's pages as ``[num_blocks, page_bytes]``
uint8. Attention always reads K/V back from the pages, prompt tokens included,
so what the model sees is exactly what the format stores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import KVPageFormat


def write_tokens(cache: torch.Tensor, fmt: KVPageFormat, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Store new tokens ``key``/``value`` ``[N, H, D]`` at ``slot_mapping``.

    Writes to a block append after its first ``min(offset)`` tokens, so each
    touched block is decoded, extended and re-encoded: statistics taken over a
    block (K per channel) then cover all of its tokens.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() == 0:
        return
    key, value = key[keep], value[keep]
    B = fmt.block_size
    blocks, offsets = slots // B, slots % B
    touched, which = torch.unique(blocks, return_inverse=True)
    filled = torch.zeros_like(touched).scatter_reduce(0, which, offsets + 1, reduce="amax")
    k, v = fmt.decode(cache[touched])
    k[which, offsets] = key.float()
    v[which, offsets] = value.float()
    cache[touched] = fmt.encode(k, v, filled)


def attend(query: torch.Tensor, cache: torch.Tensor, fmt: KVPageFormat, query_start_loc: list[int],
           seq_lens: list[int], block_table: torch.Tensor, scale: float,
           sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, Hq, D]`` over each request's pages.

    Request i owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, the
    last tokens of its ``seq_lens[i]``-token context.
    """
    out = torch.empty_like(query)
    B = fmt.block_size
    num_blocks = [-(-L // B) for L in seq_lens]
    rows = [block_table[i, :n] for i, n in enumerate(num_blocks)]
    if not rows:
        return out
    k_all, v_all = fmt.decode(cache[torch.cat(rows).long()])
    start = 0
    for i, L in enumerate(seq_lens):
        qs, qe = query_start_loc[i], query_start_loc[i + 1]
        n = num_blocks[i]
        k = k_all[start:start + n].flatten(0, 1)[:L]
        v = v_all[start:start + n].flatten(0, 1)[:L]
        start += n
        if qe == qs:
            continue
        q_pos = torch.arange(L - (qe - qs), L, device=query.device)
        k_pos = torch.arange(L, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        q = query[qs:qe].float().transpose(0, 1)  # [Hq, q, D]
        o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[qs:qe] = o.transpose(0, 1).to(query.dtype)
    return out
