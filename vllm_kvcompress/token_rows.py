"""Every prompt token of a batch as its own decode row.

A prefill chunk's token at position p attends causally to positions 0..p of its
request, which is a decode of a (p + 1)-token context over the same pages. So a
batch's prefill chunks run as one call of the decode kernel, one row per token,
with no per-request loop. Built once per step, on the device, without
synchronizing with the host. ``TokenGroups`` lets one kernel program take
several consecutive tokens of a chunk, so the chunk reads each page once per
group instead of once per token, and lists the groups (counted from the host's
copy of the query offsets, placed on the device), so that programs are launched
only for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenGroups:
    rows: torch.Tensor    # [T] int32: tokens from this one on (same request) taken together
                          # (0: taken by an earlier one)
    starts: torch.Tensor  # [groups] int32: the first token of each group
    size: int             # tokens a group takes at most


@dataclass
class TokenRows:
    seq_lens: torch.Tensor     # [T] int32: context length each token sees, itself included
    block_table: torch.Tensor  # [T, max_blocks] int32: its request's row of the block table
    max_seq_len: int
    groups: TokenGroups | None  # None: one token per program


def token_rows(query_start_loc: torch.Tensor, query_start_host: list[int], seq_lens: torch.Tensor,
               block_table: torch.Tensor, max_seq_len: int, rows_per_group: int = 1) -> TokenRows:
    """``query_start_loc`` [R+1] (and ``query_start_host``, the same offsets as a host list),
    ``seq_lens`` [R] and ``block_table`` [R, max_blocks] on the device; a request's tokens are
    grouped ``rows_per_group`` at a time from its first (1: not grouped)."""
    num_tokens = query_start_host[-1]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    # repeats alone: repeat_interleave(values, repeats) reads a lone repeat count (one request) back
    # to the host, which waits for the GPU
    request = torch.repeat_interleave(q_lens, output_size=num_tokens)
    offset = torch.arange(num_tokens, device=q_lens.device) - query_start_loc[request]
    q_len = q_lens[request]
    lens = seq_lens[request] - q_len + offset + 1
    groups = None
    if rows_per_group > 1:
        rows = torch.where(offset % rows_per_group == 0, torch.clamp(q_len - offset, max=rows_per_group),
                           0).to(torch.int32)
        starts = _group_starts(query_start_loc, q_lens, query_start_host, rows_per_group)
        groups = TokenGroups(rows, starts, rows_per_group)
    return TokenRows(lens.to(torch.int32), block_table[request], max_seq_len, groups)


def _group_starts(query_start_loc: torch.Tensor, q_lens: torch.Tensor, query_start_host: list[int],
                  rows_per_group: int) -> torch.Tensor:
    """The first token of each group, computed on the device: a host list copied over would be
    pageable memory, whose copy waits for the GPU to finish all work queued before it, and the
    host would then launch the step's layers onto an idle GPU. The host only counts the groups."""
    num_groups = sum(-(-(b - a) // rows_per_group) for a, b in zip(query_start_host, query_start_host[1:]))
    per_request = (q_lens + rows_per_group - 1) // rows_per_group
    request = torch.repeat_interleave(per_request, output_size=num_groups)  # repeats alone, as above
    first_of_request = torch.cumsum(per_request, 0) - per_request
    index = torch.arange(num_groups, device=q_lens.device) - first_of_request[request]
    return (query_start_loc[request] + index * rows_per_group).to(torch.int32)
