"""Every query token of a batch as its own decode row.

A prefill chunk's token at position p attends causally to positions 0..p of its
request, which is a decode of a (p + 1)-token context over the same pages. So a
mixed batch of decodes and prefill chunks runs as one call of the decode kernel,
one row per token, with no per-request loop. Built once per step, on the device,
without synchronizing with the host. ``group_rows`` lets one kernel program take
several consecutive tokens of a chunk, so the chunk reads each page once per
group instead of once per token; ``group_starts`` lists the groups (from the
host's copy of the query offsets), so that programs are launched only for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenRows:
    seq_lens: torch.Tensor     # [T] int32: context length each token sees, itself included
    block_table: torch.Tensor  # [T, max_blocks] int32: its request's row of the block table
    max_seq_len: int
    group_rows: torch.Tensor | None  # [T] int32: tokens from this one on (same request) taken together
                                     # (0: taken by an earlier one); None: one token per program
    group_starts: torch.Tensor | None  # [groups] int32: the first token of each group


def token_rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
               num_tokens: int, max_seq_len: int, rows_per_group: int = 1,
               query_start_host: list[int] | None = None) -> TokenRows:
    """``query_start_loc`` [R+1], ``seq_lens`` [R] and ``block_table`` [R, max_blocks] on the device;
    a request's tokens are grouped ``rows_per_group`` at a time from its first (1: not grouped),
    which needs ``query_start_host``, the same offsets as a host list."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    request = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=q_lens.device), q_lens,
                                      output_size=num_tokens)
    offset = torch.arange(num_tokens, device=q_lens.device) - query_start_loc[request]
    lens = seq_lens[request] - q_lens[request] + offset + 1
    group = starts = None
    if rows_per_group > 1:
        group = torch.where(offset % rows_per_group == 0,
                            torch.clamp(q_lens[request] - offset, max=rows_per_group), 0).to(torch.int32)
        first = [t for a, b in zip(query_start_host, query_start_host[1:]) for t in range(a, b, rows_per_group)]
        starts = torch.tensor(first, dtype=torch.int32).to(q_lens.device, non_blocking=True)
    return TokenRows(lens.to(torch.int32), block_table[request], max_seq_len, group, starts)
