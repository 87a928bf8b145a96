"""Every prompt token of a batch as a decode row over its request's history.

A prefill chunk's tokens attend to their own chunk exactly (FlashAttention over
the new K/V) and to the request's tokens before the chunk from the pages: that
second part is, for every token of the chunk, a decode of the same history. So a
batch's prefill chunks read their history in one call of the decode kernel, one
row per token, with no per-request loop. ``TokenGroups`` lets one kernel program
take several consecutive tokens of a chunk, so the chunk reads each page once
per group instead of once per token, and lists the groups, so that programs are
launched only for them.

Built once per step without synchronizing with the host. Which request each token
belongs to, its place in its chunk and the groups depend only on the query offsets,
which the host has exactly, and so are the chunks' histories (vLLM's host context
lengths are exact for prompt chunks): they are computed there with numpy and sent in
one asynchronous copy from pinned memory. Only each token's row of the block table is
gathered on the device. The same indices built by about fifteen small torch ops on the
device cost the host 450 to 600 us a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class TokenGroups:
    rows: torch.Tensor    # [T] int32: tokens from this one on (same request) taken together
                          # (0: taken by an earlier one)
    starts: torch.Tensor  # [groups] int32: the first token of each group
    size: int             # tokens a group takes at most


@dataclass
class TokenRows:
    seq_lens: torch.Tensor     # [T] int32: the history each token reads from the pages (its chunk's)
    block_table: torch.Tensor  # [T, max_blocks] int32: its request's row of the block table
    histories: list[int]       # [R]: each chunk's history, on the host
    max_seq_len: int           # the longest history (0: no chunk has one)
    groups: TokenGroups | None  # None: one token per program
    query_start: torch.Tensor  # [R+1] int32: the chunks' token offsets, from 0 (FlashAttention's cu_seqlens)
    query_start_host: list[int]  # the same, on the host
    max_query_len: int         # the longest chunk
    offsets: torch.Tensor      # [T] int32: each token's place in its chunk
    _first_keys: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    # what the prompt kernels plan once a step and every layer reuses (``history.step_groups``)
    step_plans: dict = field(default_factory=dict, repr=False)

    def first_keys(self, window: int) -> torch.Tensor:
        """[T] int32: the first key each token sees in a layer of this sliding ``window`` (token p sees
        keys p - window < j <= p; the result may be below 0). Made once a step for each window."""
        if window not in self._first_keys:
            self._first_keys[window] = self.seq_lens + (self.offsets - (window - 1))
        return self._first_keys[window]


def token_rows(query_start_host: list[int], histories: list[int], block_table: torch.Tensor,
               rows_per_group: int = 1) -> TokenRows:
    """``query_start_host``: the R chunks' token offsets on the host, from 0 ([R+1]); ``histories``
    [R]: each chunk's history (its request's tokens before it), on the host; ``block_table`` [R,
    max_blocks] on the device. A request's tokens are grouped ``rows_per_group`` at a time from its
    first (1: not grouped)."""
    starts = np.asarray(query_start_host, dtype=np.int32)
    q_lens = np.diff(starts)
    num_tokens = int(starts[-1])
    request = np.repeat(np.arange(len(q_lens), dtype=np.int32), q_lens)
    offset = np.arange(num_tokens, dtype=np.int32) - starts[request]
    q_len = q_lens[request]  # of each token's chunk
    parts = [starts, request, np.asarray(histories, dtype=np.int32)[request], offset]
    if rows_per_group > 1:
        per_request = -(-q_lens // rows_per_group)
        first_group = np.repeat(np.cumsum(per_request) - per_request, per_request)
        group_starts = (np.repeat(starts[:-1], per_request)
                        + (np.arange(len(first_group), dtype=np.int32) - first_group) * rows_per_group)
        parts += [np.where(offset % rows_per_group == 0, np.minimum(q_len - offset, rows_per_group), 0),
                  group_starts]
    query_start, request_dev, history, offset_dev, *grouping = aligned_to_device(parts, block_table.device)
    groups = TokenGroups(grouping[0], grouping[1], rows_per_group) if grouping else None
    return TokenRows(history, block_table[request_dev], list(histories), max(histories, default=0), groups,
                     query_start, list(query_start_host), int(q_lens.max(initial=0)), offset_dev)


def aligned_to_device(parts: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int32 arrays to ``device`` in one copy, each starting 16 bytes apart from the others (the
    Triton kernels are compiled for 16-byte aligned pointers: a view at another offset would be
    compiled again in the middle of serving). On CUDA the copy leaves from pinned memory, so it is
    queued behind the GPU's work instead of waiting for it (pageable memory would make the host
    wait, and then launch the step's layers onto an idle GPU)."""
    sizes = [len(p) for p in parts]
    offsets = np.cumsum([0] + [-(-n // 4) * 4 for n in sizes])
    staged = torch.empty(int(offsets[-1]), dtype=torch.int32, pin_memory=device.type == "cuda")
    host = staged.numpy()
    for part, at in zip(parts, offsets):
        host[at: at + len(part)] = part
    on_device = staged.to(device, non_blocking=True)
    return [on_device[at: at + n] for at, n in zip(offsets.tolist(), sizes)]
