"""ZipCache's torch path: attention over salient-token pages, saliency from probe queries, and the
write that chooses each block's 4-bit tokens (``formats.salient``).

A step's new tokens are written after its attention, which reads them exact (a decode too): the
choice needs the attention they receive. Saliency comes from a few probe rows of the step, never
the full attention matrix: a chunk's newest ``probe_recent`` share and a seeded random
``probe_random`` share of the others (a decode's one row is its probe). A token's normalized
attention (ZipCache) is the attention the probes give it, summed over the query heads of its KV
head, divided by the number of probes that see it; ``accumulated`` leaves out the division (H2O,
MiKV) and ``random`` draws scores at random (the two baselines of the paper).

Every write re-compresses the blocks it touches, per KV head: of the block's tokens that still have
4-bit codes and the new ones, the ``quota`` the probes score highest keep them. A token never gains
precision back. Between re-compressions of a decoding request (every ``recompress_interval`` tokens
of its context), a new token is held at 4 bits while its block has a free slot, and takes the slot
of the lowest-scored one when not (docs/formats.md).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .config import SalientSpec
from .formats.salient import SalientTokensFormat
from .token_rows import aligned_to_device


def probe_rows(num_rows: int, end: int, spec: SalientSpec) -> torch.Tensor:
    """Which of a step's ``num_rows`` query rows of one request (context positions ``end - num_rows ..
    end - 1``) are probes: the newest ``ceil(probe_recent * n)`` (the newest one at least) and
    ``ceil(probe_random * n)`` of the others at random, drawn with ``spec.seed`` and ``end``."""
    return torch.tensor(probe_row_list(num_rows, end, spec), dtype=torch.long)


def probe_row_list(num_rows: int, end: int, spec: SalientSpec) -> list[int]:
    """``probe_rows`` as a list, ascending (what a step's plan lists on the host)."""
    recent = max(1, math.ceil(spec.probe_recent * num_rows - 1e-9))
    rest = num_rows - recent
    drawn = min(rest, math.ceil(spec.probe_random * num_rows - 1e-9))
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + end)
    return sorted(torch.randperm(rest, generator=generator)[:drawn].tolist()) + list(range(rest, num_rows))


def token_scores(probes: torch.Tensor, probe_pos: torch.Tensor, k: torch.Tensor, first: int, scale: float,
                 spec: SalientSpec, sliding_window: int | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """[L, H] saliency of the keys ``k`` [L, H, D] at positions ``first..`` from ``probes`` [Hq, P, D]
    at context positions ``probe_pos`` [P]: their attention probabilities over ``k``, or, given the
    log-sum-exp ``lse`` [Hq, P] of each probe's attention over a context that ``k`` is part of, over
    that context."""
    L, H, _ = k.shape
    if spec.score == "random":  # the draw for the whole context, whichever part k holds
        return _random_scores(first + L, H, spec)[first:].to(k.device)
    group = probes.shape[0] // H
    k_pos = torch.arange(first, first + L, device=k.device)
    sees = k_pos[None, :] <= probe_pos[:, None]  # [P, L]
    if sliding_window is not None:
        sees &= k_pos[None, :] > probe_pos[:, None] - sliding_window
    logits = probes @ k.repeat_interleave(group, 1).permute(1, 2, 0) * scale  # [Hq, P, L]
    if lse is None:
        probs = logits.masked_fill(~sees, float("-inf")).softmax(-1)
    else:
        probs = (logits - lse[..., None]).exp().masked_fill(~sees, 0.0)
    total = probs.unflatten(0, (H, group)).sum(dim=(1, 2))  # [H, L]
    if spec.score == "normalized":
        total = total / sees.sum(0).clamp_min(1)
    return total.transpose(0, 1)


def _random_scores(num_tokens: int, heads: int, spec: SalientSpec) -> torch.Tensor:
    """[num_tokens, heads] scores drawn for a request's first ``num_tokens`` tokens."""
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + num_tokens)
    return torch.rand(num_tokens, heads, generator=generator)


def keep_top(scores: torch.Tensor, candidates: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """[N, B, H] bool: per block and head, the ``quota`` [N] best-scored of the ``candidates``."""
    ranked = torch.where(candidates, scores, float("-inf")).argsort(dim=1, descending=True, stable=True)
    order = torch.arange(scores.shape[1], device=scores.device).view(1, -1, 1).expand_as(ranked)
    rank = torch.empty_like(ranked).scatter_(1, ranked, order)
    return candidates & (rank < quota[:, None, None])


def attend_and_write(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                     fmt: SalientTokensFormat, spec: SalientSpec, query_start_loc: list[int],
                     seq_lens: list[int], block_table: torch.Tensor, scale: float,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of ``query`` [T, Hq, D] over each request's earlier tokens from the pages and
    its step's own ``key``/``value`` [T, H, D] exact; then the step's tokens go into the pages."""
    out = torch.empty_like(query)
    B = fmt.block_size
    for i, L in enumerate(seq_lens):
        qs, qe = query_start_loc[i], query_start_loc[i + 1]
        m = qe - qs
        if m == 0:
            continue
        history = L - m
        first_block = 0 if sliding_window is None else max(0, history - sliding_window + 1) // B
        first = first_block * B
        old_pages = cache[block_table[i, first_block:-(-L // B)].long()]
        k, v = (t.flatten(0, 1)[:L - first] for t in fmt.decode(old_pages))
        k[history - first:], v[history - first:] = key[qs:qe].float(), value[qs:qe].float()
        q = query[qs:qe].float().transpose(0, 1)  # [Hq, m, D]
        q_pos = torch.arange(history, L, device=query.device)
        k_pos = torch.arange(first, L, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        out[qs:qe] = o.transpose(0, 1).to(query.dtype)
        rows = probe_rows(m, L, spec).to(query.device)
        scores = token_scores(q[:, rows], q_pos[rows], k, first, scale, spec, sliding_window)
        _write(cache, fmt, spec, block_table[i], history, L, k, v, scores, first, old_pages)
    return out


def _write(cache: torch.Tensor, fmt: SalientTokensFormat, spec: SalientSpec, blocks: torch.Tensor, history: int,
           L: int, k: torch.Tensor, v: torch.Tensor, scores: torch.Tensor, first: int,
           old_pages: torch.Tensor) -> None:
    """Re-compress the blocks holding positions ``history..L-1`` with those tokens added. ``k``, ``v``,
    ``scores``: the request's tokens from position ``first`` (a block start) on."""
    B = fmt.block_size
    a, b = history // B, -(-L // B)  # the touched blocks
    skip = (a * B - first) // B  # of old_pages, those before the touched blocks
    n = b - a
    span = slice(a * B - first, b * B - first)

    def blockwise(t: torch.Tensor, fill: float) -> torch.Tensor:
        padded = torch.full((n * B, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
        part = t[span]
        padded[:part.shape[0]] = part
        return padded.unflatten(0, (n, B))

    stored = old_pages[skip:skip + n]  # a block the step opens holds bytes of no token yet
    start = torch.arange(a * B, b * B, B, device=k.device)
    holding = torch.full((n,), L - history == 1 and L % spec.recompress_interval != 0, device=k.device)
    cache[blocks[a:b].long()] = _recompressed(fmt, stored, blockwise(k, 0.0), blockwise(v, 0.0),
                                              blockwise(scores, float("-inf")), (history - start).clamp(0, B),
                                              (L - start).clamp(max=B), holding)


@dataclass
class ChunkWrites:
    """The blocks a step's prompt chunks touch, what each holds before and after, and the probes that
    score its tokens (``plan_chunk_writes``; the same for every layer of the step)."""
    blocks: torch.Tensor       # [N] the touched blocks
    num_stored: torch.Tensor   # [N] int32: tokens each held before the step
    filled: torch.Tensor       # [N] int32: tokens each holds after it
    first_row: torch.Tensor    # [N] int32: the step's row (of key, value) of each block's first new token
    quota: torch.Tensor        # [N] int32: the 4-bit tokens each keeps (its slots, where a decoded token is held)
    start: torch.Tensor        # [N] int32: the context position of each block's first token
    probe_first: torch.Tensor  # [N] int32: its request's first probe in ``probe_rows``
    probe_end: torch.Tensor    # [N] int32: and one past its last
    probe_rows: torch.Tensor   # [P] int32: the probes' rows of the step's queries
    probe_pos: torch.Tensor    # [P] int32: their context positions
    scores: torch.Tensor | None  # [N, B, H] float32 drawn scores (``random``); None: from the probes
    fresh: int                 # the first ``fresh`` blocks held no token before the step, the others some
    launch_plans: dict = field(default_factory=dict, repr=False)  # the kernels' launches, kept for the step's layers


def plan_chunk_writes(fmt: SalientTokensFormat, spec: SalientSpec, query_start_loc: list[int], seq_lens: list[int],
                      block_table: torch.Tensor) -> ChunkWrites | None:
    """The writes of each request's step tokens into its pages, as ``_write`` makes one request's, for
    a kernel to carry out (``salient_write``), with each request's probes as ``attend_and_write``
    draws them. Made on the host and sent in one copy (``token_rows.aligned_to_device``), without
    waiting for the device. None: no request has tokens."""
    B, H = fmt.block_size, fmt.k.num_heads
    dev = block_table.device
    quotas = fmt.quotas
    columns = []  # per touched block: row, block of the request, num_stored, filled, first_row, quota, start, probes
    rows_of_probes, pos_of_probes, drawn = [], [], []
    for i, L in enumerate(seq_lens):
        qs, m = query_start_loc[i], query_start_loc[i + 1] - query_start_loc[i]
        if not m:
            continue
        history = L - m
        a, b = history // B, -(-L // B)
        holding = m == 1 and L % spec.recompress_interval != 0  # a decoded token held: the block keeps its slots
        probes = (len(rows_of_probes), len(rows_of_probes))
        if spec.score == "random":  # the draw attend_and_write makes for the whole context
            drawn.append(F.pad(_random_scores(L, H, spec)[a * B:], (0, 0, 0, (b - a) * B - (L - a * B)),
                               value=float("-inf")))
        else:
            rows = probe_row_list(m, L, spec)
            rows_of_probes += [qs + r for r in rows]
            pos_of_probes += [history + r for r in rows]
            probes = (probes[0], len(rows_of_probes))
        for c in range(a, b):
            start = c * B
            filled = min(L - start, B)
            columns.append((i, c, min(max(history - start, 0), B), filled, qs + max(start - history, 0),
                            fmt.slots if holding else quotas[filled], start, *probes))
    if not columns:
        return None
    # blocks that held nothing first: the write takes them through a kernel that reads no stored token
    order = sorted(range(len(columns)), key=lambda c: columns[c][2] > 0)
    fresh = sum(column[2] == 0 for column in columns)
    table = np.array([columns[c] for c in order], dtype=np.int32).T
    row, column, *per_block, probe_rows_dev, probe_pos_dev = aligned_to_device(
        [*table, np.asarray(rows_of_probes, np.int32), np.asarray(pos_of_probes, np.int32)], dev)
    scores = None if not drawn else torch.cat(drawn).view(len(columns), B, H)[order].to(dev, non_blocking=True)
    return ChunkWrites(block_table[row.long(), column.long()], *per_block, probe_rows_dev, probe_pos_dev, scores,
                       fresh)


def _recompressed(fmt: SalientTokensFormat, stored: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scores: torch.Tensor, num_stored: torch.Tensor, filled: torch.Tensor,
                  holding: torch.Tensor) -> torch.Tensor:
    """Blocks ``stored`` [N, page_bytes] with tokens ``num_stored..filled-1`` [N] added (``k``, ``v``
    [N, B, H, D] hold all their tokens), re-compressed: of the tokens that still have 4 bits and the
    new ones, the best ``scores`` [N, B, H] keep them, up to the block's quota, or up to its slots
    where ``holding`` [N] (a decoded token held until the next re-compression)."""
    tokens = torch.arange(fmt.block_size, device=k.device)[None, :]
    is_new = (tokens >= num_stored[:, None]) & (tokens < filled[:, None])
    candidates = (fmt.salient(stored) & (tokens < num_stored[:, None])[..., None]) | is_new[..., None]
    return fmt.encode(k, v, filled, keep_top(scores, candidates, _block_quota(fmt, filled, holding)), stored,
                      num_stored)


def _block_quota(fmt: SalientTokensFormat, filled: torch.Tensor, holding: torch.Tensor) -> torch.Tensor:
    """4-bit tokens blocks of ``filled`` tokens keep: all their slots where ``holding`` (a decoded token
    held until the next re-compression), else their quota."""
    return torch.where(holding, fmt.slots, fmt.quota(filled))


# the window the kernels give a layer without one: a probe sees every token before it
NO_WINDOW = 1 << 30


@functools.cache
def quota_table(fmt: SalientTokensFormat, device: torch.device) -> torch.Tensor:
    """[B + 1] int32 on ``device``: the 4-bit tokens a block of n tokens keeps after a re-compression
    (what the kernels look up): ``fmt.quotas`` on the device."""
    return torch.tensor(fmt.quotas, dtype=torch.int32, device=device)


def last_block_random_scores(seq_lens: torch.Tensor, block_size: int, heads: int, spec: SalientSpec) -> torch.Tensor:
    """[N, B, H] the draw ``attend_and_write`` makes for each request's whole context, its last block
    (``random`` scores)."""
    B = block_size
    draws = [(_random_scores(L, heads, spec), L) for L in seq_lens.tolist()]
    return torch.stack([F.pad(d[(L - 1) // B * B:], (0, 0, 0, B - 1 - (L - 1) % B)) for d, L in draws]).to(
        seq_lens.device)


def write_decoded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                  fmt: SalientTokensFormat, spec: SalientSpec, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  lse: torch.Tensor, scale: float) -> None:
    """Each decode row's new token into its last block, all rows at once, re-compressed as ``_write``
    re-compresses, scored by the row's query (its probe) with ``lse`` [N, Hq], the log-sum-exp of
    its attention over the whole context."""
    n, B, H = query.shape[0], fmt.block_size, fmt.k.num_heads
    rows = torch.arange(n, device=query.device)
    length = seq_lens.long()
    offset = (length - 1) % B
    blocks = block_table[rows, (length - 1) // B].long()
    stored = cache[blocks]
    k, v = fmt.decode(stored)
    k[rows, offset], v[rows, offset] = key.float(), value.float()
    if spec.score == "random":
        scores = last_block_random_scores(seq_lens, B, H, spec)
    else:
        logits = torch.einsum("nqd,nbqd->nqb", query.float(), k.repeat_interleave(query.shape[1] // H, 2)) * scale
        scores = (logits - lse[..., None]).exp().unflatten(1, (H, -1)).sum(2).transpose(1, 2)  # [N, B, H]
    holding = length % spec.recompress_interval != 0
    cache[blocks] = _recompressed(fmt, stored, k, v, scores, offset, offset + 1, holding)
