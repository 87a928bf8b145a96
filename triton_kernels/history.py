"""Prompt chunks whose history is read back once into 16-bit rows, then FlashAttention over it all.

A chunk's history (its request's tokens before the chunk) is turned back into K and V in the model's
dtype once per step and layer, a program per (page, KV head, 32 tokens), into a contiguous buffer where
the chunk's own new K/V follow it; vLLM's FlashAttention then runs every chunk over its history and
own tokens together (causal, aligned at the end, so a chunk's first token sees all of its history).
The decode kernel's route (``prompt.paged_prompt``) decodes the history again for every group of a
chunk's query rows and runs its products on the codes; here the codes are decoded once and the
products run at FlashAttention's speed, for one write and one read of the 16-bit rows
(``docs/architecture.md``, "Prompt chunks").

Serves pages of min-max codes (K per channel, V per token, ZipCache channel scales) or raw 16-bit
values, without outlier tokens. A sliding-window layer decodes only the pages from the one holding
its chunk's first visible key. The buffer lives for the call; chunks are taken in groups of at most
``KEY_BUFFER_BYTES`` of rows, and a step with a chunk longer than that takes the decode kernel's
route, which needs no buffer: the memory the route takes is bounded whatever the model's length.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats import KVPageFormat
from vllm_kvcompress.formats.layout import TensorLayout, page_layout
from vllm_kvcompress.formats.salient import MIDDLE, NO_SLOT, SalientTokensFormat
from vllm_kvcompress.token_rows import TokenRows, aligned_to_device

from .addressing import code_unit_ptr
from .decode import salient_constants
from .decode import warm_up as decode_warm_up
from .launch import Variant, launch
from .prompt import chunks_attention, own_chunk_attention, paged_prompt

KEY_BUFFER_BYTES = 512 << 20  # a group's K and V rows in the model's dtype, at most
# Below this many query heads' rows for each KV head's history token, decoding the history ahead costs
# more than the decode kernel's route saves: the decode costs a history token's KV heads, the products
# it saves its query heads' rows (``kernels.py --prompts``, docs/architecture.md "Prompt chunks")
MIN_HEAD_ROWS_A_HISTORY_TOKEN = 192
TOKEN_TILE = 32  # tokens of a page a program decodes
_NO_SLOT = tl.constexpr(NO_SLOT)
_MIDDLE = tl.constexpr(MIDDLE)


@triton.jit
def _values(page, t, d, h, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
            CODES: tl.constexpr, ROW: tl.constexpr, GROUP: tl.constexpr, SCALE: tl.constexpr, ZERO: tl.constexpr,
            CS: tl.constexpr, dtype: tl.constexpr):
    """Tokens ``t`` [T, 1], channels ``d`` [1, D] of head ``h`` of one tensor of a page as float32, as
    ``MinMaxCodec.decode`` (or ``UncompressedCodec.decode`` at 16 bits) gives them."""
    if BITS == 16:  # raw values, token-major rows [B, H, D]
        return tl.load((page + CODES + (t * H + h) * ROW).to(tl.pointer_type(dtype)) + d).to(tl.float32)
    if BITS == 3:  # a 2-bit plane (channel c: byte c // 4) and a 1-bit plane (byte c // 8) after it
        lo = tl.load(code_unit_ptr(page, CODES, t, h, d // 4, ROW, BLOCK, GROUP)).to(tl.int32)
        hi = tl.load(code_unit_ptr(page, CODES, t, h, ROW * 2 // 3 + d // 8, ROW, BLOCK, GROUP)).to(tl.int32)
        code = ((lo >> (2 * (d % 4))) & 3) | (((hi >> (d % 8)) & 1) << 2)
    else:
        byte = tl.load(code_unit_ptr(page, CODES, t, h, d // (8 // BITS), ROW, BLOCK, GROUP)).to(tl.int32)
        code = (byte >> ((d % (8 // BITS)) * BITS)) & ((1 << BITS) - 1)
    half = page.to(tl.pointer_type(tl.float16))
    if GROUP > 0:  # statistics per token, head-major [H, B]
        scale = tl.load(half + SCALE // 2 + h * BLOCK + t)
        zero = tl.load(half + ZERO // 2 + h * BLOCK + t)
    else:  # per channel [H, D]
        scale = tl.load(half + SCALE // 2 + h * D + d)
        zero = tl.load(half + ZERO // 2 + h * D + d)
    x = code.to(tl.float32) * scale.to(tl.float32) + zero.to(tl.float32)
    if CS >= 0:
        x = x * tl.load(half + CS // 2 + h * D + d).to(tl.float32)
    return x


@triton.jit
def _salient_values(page, t, d, h, D: tl.constexpr, BLOCK: tl.constexpr, HIGH: tl.constexpr, LOW: tl.constexpr,
                    SLOT_OF: tl.constexpr, SLOTS: tl.constexpr, SCALE: tl.constexpr, ZERO: tl.constexpr,
                    PER_TOKEN: tl.constexpr):
    """Tokens ``t`` [T, 1], channels ``d`` [1, D] of head ``h`` of K or V of a ZipCache page as float32,
    as ``SalientTokensFormat.decode`` gives them: the 4-bit code ``4 high + low`` of a token with a
    refinement row (``slot_of``), ``4 high + 1.5`` of one without, on the 4-bit grid."""
    ROW: tl.constexpr = D // 4  # 2-bit codes, head-major rows [H, B, ROW] and [H, SLOTS, ROW]
    shift = 2 * (d % 4)
    high = (tl.load(page + HIGH + (h * BLOCK + t) * ROW + d // 4).to(tl.int32) >> shift) & 3
    slot = tl.load(page + SLOT_OF + h * BLOCK + t).to(tl.int32)
    refined = slot != _NO_SLOT
    low = tl.load(page + LOW + (h * SLOTS + tl.where(refined, slot, 0)) * ROW + d // 4, mask=refined & (d < D),
                  other=0)
    code = 4.0 * high.to(tl.float32) + tl.where(refined, ((low.to(tl.int32) >> shift) & 3).to(tl.float32), _MIDDLE)
    half = page.to(tl.pointer_type(tl.float16))
    at = h * BLOCK + t if PER_TOKEN else h * D + d
    return code * tl.load(half + SCALE // 2 + at).to(tl.float32) + tl.load(half + ZERO // 2 + at).to(tl.float32)


# the table's stride and address take no specialization: a step's tables (slices of vLLM's) differ
# from the warm-up's, and a compile in the middle of serving stalls the step
@triton.jit(do_not_specialize=["block_table_ptr", "bt_stride"])
def _history_kernel(cache_ptr, block_table_ptr, bt_stride, item_ptr, k_ptr, v_ptr, page_bytes,
                    H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TT: tl.constexpr,
                    K_BITS: tl.constexpr, K_CODES: tl.constexpr, K_ROW: tl.constexpr, K_GROUP: tl.constexpr,
                    K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
                    V_BITS: tl.constexpr, V_CODES: tl.constexpr, V_ROW: tl.constexpr, V_GROUP: tl.constexpr,
                    V_SCALE: tl.constexpr, V_ZERO: tl.constexpr, V_CS: tl.constexpr,
                    SALIENT: tl.constexpr, K_LOW: tl.constexpr, V_LOW: tl.constexpr, SLOT_OF: tl.constexpr,
                    SLOTS: tl.constexpr):
    """Item program_id(0) (``HistoryPlan.items``: block-table row, column, first output row, tokens),
    KV head program_id(1), tokens ``TT * program_id(2)`` on: those of the page's history tokens' K
    and V into rows of ``k``/``v`` [rows, H, D]. SALIENT: ZipCache's pages (the high planes at
    ``K_CODES``/``V_CODES``, refinement rows at ``K_LOW``/``V_LOW``)."""
    item = item_ptr + tl.program_id(0) * 4
    h = tl.program_id(1)
    row, col, dest, count = tl.load(item), tl.load(item + 1), tl.load(item + 2), tl.load(item + 3)
    t0 = tl.program_id(2) * TT
    if t0 >= count:
        return
    block = tl.load(block_table_ptr + row.to(tl.int64) * bt_stride + col).to(tl.int64)
    page = cache_ptr + block * page_bytes
    d = tl.arange(0, D)[None, :]
    t = t0 + tl.arange(0, TT)[:, None]
    keep = t < count
    at = ((dest + t).to(tl.int64) * H + h) * D + d
    if SALIENT:
        k = _salient_values(page, t, d, h, D, BLOCK, K_CODES, K_LOW, SLOT_OF, SLOTS, K_SCALE, K_ZERO, False)
        tl.store(k_ptr + at, k.to(k_ptr.dtype.element_ty), mask=keep)
        v = _salient_values(page, t, d, h, D, BLOCK, V_CODES, V_LOW, SLOT_OF, SLOTS, V_SCALE, V_ZERO, True)
        tl.store(v_ptr + at, v.to(v_ptr.dtype.element_ty), mask=keep)
        return
    k = _values(page, t, d, h, H, D, BLOCK, K_BITS, K_CODES, K_ROW, K_GROUP, K_SCALE, K_ZERO, -1,
                k_ptr.dtype.element_ty)
    tl.store(k_ptr + at, k.to(k_ptr.dtype.element_ty), mask=keep)
    if V_GROUP > 0:  # a byte's codes of a group's tokens lie together: loaded [D, TT], tokens contiguous
        v = tl.trans(_values(page, tl.trans(t), tl.trans(d), h, H, D, BLOCK, V_BITS, V_CODES, V_ROW, V_GROUP,
                             V_SCALE, V_ZERO, V_CS, v_ptr.dtype.element_ty))
    else:
        v = _values(page, t, d, h, H, D, BLOCK, V_BITS, V_CODES, V_ROW, V_GROUP, V_SCALE, V_ZERO, V_CS,
                    v_ptr.dtype.element_ty)
    tl.store(v_ptr + at, v.to(v_ptr.dtype.element_ty), mask=keep)


def _tensor_constants(prefix: str, lay: TensorLayout) -> dict:
    return {f"{prefix}_BITS": lay.bits, f"{prefix}_CODES": lay.codes, f"{prefix}_ROW": lay.row_bytes,
            f"{prefix}_GROUP": lay.token_group, f"{prefix}_SCALE": lay.scale, f"{prefix}_ZERO": lay.zero}


def _tile(block_size: int) -> int:
    return min(TOKEN_TILE, block_size)  # both powers of two


@functools.cache  # one Variant a format: launch keeps its compiled kernel by it
def _variant(fmt: KVPageFormat | SalientTokensFormat) -> Variant:
    lay = page_layout(fmt)
    return Variant(_history_kernel, dict(H=lay.num_kv_heads, D=lay.head_size, BLOCK=lay.block_size,
                                         TT=_tile(lay.block_size), **_tensor_constants("K", lay.k),
                                         **_tensor_constants("V", lay.v), V_CS=lay.v.channel_scale,
                                         **salient_constants(fmt)),
                   {"num_warps": 4})


class HistoryPlan:
    """Where a group of consecutive chunks' rows go in the buffer, from the host's lengths.

    Chunk i's keys are rows ``key_start[i]:key_start[i + 1]``: its history from the first page it
    sees (``first_page``), then its own tokens. ``items`` [P, 4] int32: for each page to decode,
    the block-table row it is read through (the chunk's first token's), its column, its first output
    row and how many of its tokens are history; ``own_rows`` [T]: each chunk token's output row."""

    def __init__(self, query_start: list[int], histories: list[int], block_size: int, window: int | None):
        q_lens = np.diff(np.asarray(query_start, dtype=np.int64))
        hist = np.where(q_lens > 0, np.asarray(histories, dtype=np.int64), 0)  # no rows: nothing to read
        first_visible = np.zeros_like(hist) if window is None else np.maximum(hist - window + 1, 0)
        first_page = first_visible // block_size
        kept = hist - first_page * block_size  # history rows, from the first page seen
        key_lens = kept + q_lens
        self.key_start = np.concatenate([[0], np.cumsum(key_lens)])
        self.max_key_len = int(key_lens.max(initial=0))
        last_page = -(-hist // block_size)
        pages = last_page - first_page
        chunk = np.repeat(np.arange(len(hist)), pages)
        col = np.arange(int(pages.sum())) - np.repeat(np.cumsum(pages) - pages, pages) + first_page[chunk]
        self.items = np.stack([np.asarray(query_start[:-1], dtype=np.int64)[chunk], col,
                               self.key_start[chunk] + (col - first_page[chunk]) * block_size,
                               np.minimum(block_size, hist[chunk] - col * block_size)], axis=1)
        token_chunk = np.repeat(np.arange(len(hist)), q_lens)
        offset = np.arange(int(q_lens.sum())) - np.repeat(np.asarray(query_start[:-1]), q_lens)
        self.own_rows = self.key_start[token_chunk] + kept[token_chunk] + offset

    @property
    def num_keys(self) -> int:
        return int(self.key_start[-1])


def key_groups(query_start: list[int], histories: list[int], row_bytes: int) -> list[tuple[int, int]]:
    """Consecutive chunks ``(first, end)`` whose keys (history and own tokens, ``row_bytes`` each in
    K and V together) fit ``KEY_BUFFER_BYTES`` (``fits_buffer``: each chunk alone does)."""
    groups, first, rows = [], 0, 0
    for i, history in enumerate(histories):
        n = history + query_start[i + 1] - query_start[i]
        if i > first and (rows + n) * row_bytes > KEY_BUFFER_BYTES:
            groups.append((first, i))
            first, rows = i, 0
        rows += n
    groups.append((first, len(histories)))
    return groups


def history_rows(cache: torch.Tensor, fmt: KVPageFormat | SalientTokensFormat, block_table: torch.Tensor,
                 plan: HistoryPlan, items: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [plan.num_keys, H, D] in ``dtype``, the history rows decoded from the pages (``items``:
    ``plan.items`` on the device; ``block_table`` [T, max_blocks], a row per chunk token); the own
    tokens' rows are left for the caller."""
    H, D = fmt.k.num_heads, fmt.k.head_size
    k = torch.empty(plan.num_keys, H, D, dtype=dtype, device=cache.device)
    v = torch.empty_like(k)
    if len(plan.items):
        launch(_variant(fmt), (len(plan.items), H, fmt.block_size // _tile(fmt.block_size)),
               (cache, block_table, block_table.stride(0), items, k, v, fmt.page_bytes))
    return k, v


def prompt_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                  fmt: KVPageFormat, rows: TokenRows, sm_scale: float, out: torch.Tensor,
                  window: int | None = None) -> torch.Tensor:
    """``query`` [T, Hq, D] and the chunks' new ``key``/``value`` [T, H, D], laid out by ``rows``
    (``token_rows``); the attention goes to ``out`` [T, Hq, D]. ``window``: the layer's sliding
    window (token p sees keys p - window < j <= p). A step whose chunks have fewer than
    ``MIN_HEAD_ROWS_A_HISTORY_TOKEN`` query rows times query heads a KV head for each history token
    they read (weighted by history), or one of whose chunks does not fit ``KEY_BUFFER_BYTES``, takes
    the decode kernel's route (``prompt.paged_prompt``), which decodes nothing ahead."""
    if not rows.max_seq_len:  # no chunk has history
        own_chunk_attention(query, key, value, rows.query_start, rows.max_query_len, sm_scale, out, window)
        return out
    if not decodes_ahead(rows, query, key):
        return paged_prompt(query, key, value, cache, fmt, rows, sm_scale, out, window)
    dense_prompt(query, key, value, cache, fmt, rows, sm_scale, out, window)
    return out


def kv_row_bytes(key: torch.Tensor) -> int:
    """Bytes of a key's K and V rows in the buffer (all KV heads, the model's dtype)."""
    return 2 * key.shape[1] * key.shape[2] * key.element_size()


def decodes_ahead(rows: TokenRows, query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether a step takes the history route: some chunk has history, its chunks have at least
    ``MIN_HEAD_ROWS_A_HISTORY_TOKEN`` query rows times query heads a KV head (of ``query`` [T, Hq, D]
    and ``key`` [T, H, D]) for each history token, averaged over the history tokens, and each chunk's
    keys fit ``KEY_BUFFER_BYTES``. Decided once a step (kept on ``rows``)."""
    if not rows.max_seq_len:
        return False
    group, row_bytes = query.shape[1] // key.shape[1], kv_row_bytes(key)
    plan = ("decodes ahead", group, row_bytes)
    if plan not in rows.step_plans:
        starts, histories = rows.query_start_host, rows.histories
        rows_times_history = sum((b - a) * h for a, b, h in zip(starts, starts[1:], histories))
        longest = max(h + b - a for a, b, h in zip(starts, starts[1:], histories))
        rows.step_plans[plan] = (rows_times_history * group >= MIN_HEAD_ROWS_A_HISTORY_TOKEN * sum(histories)
                                 and longest * row_bytes <= KEY_BUFFER_BYTES)
    return rows.step_plans[plan]


@dataclass
class StepGroup:
    """A group of consecutive chunks (``key_groups``) as every layer of a step runs it."""
    tokens: slice              # the group's query rows in the step's prompt tokens
    plan: HistoryPlan
    items: torch.Tensor        # plan.items on the device
    own_rows: torch.Tensor     # plan.own_rows on the device (int64, index_copy's)
    query_start: torch.Tensor  # the group's chunks' query offsets, from 0
    key_start: torch.Tensor    # plan.key_start on the device
    max_query_len: int


def step_groups(rows: TokenRows, block_size: int, window: int | None, row_bytes: int,
                device: torch.device) -> list[StepGroup]:
    """The step's groups of chunks and their plans, made once a step (kept on ``rows``) for each
    page size, window and row size: the host's planning and copy cost every layer otherwise."""
    key = ("history", block_size, window, row_bytes)
    if key not in rows.step_plans:
        starts, groups = rows.query_start_host, []
        for first, end in key_groups(starts, rows.histories, row_bytes):
            qs, qe = starts[first], starts[end]
            group_starts = [x - qs for x in starts[first:end + 1]]
            plan = HistoryPlan(group_starts, rows.histories[first:end], block_size, window)
            items, own_rows, query_start, key_start = aligned_to_device(
                [plan.items.astype(np.int32).ravel(), plan.own_rows.astype(np.int32),
                 np.asarray(group_starts, dtype=np.int32), plan.key_start.astype(np.int32)], device)
            groups.append(StepGroup(slice(qs, qe), plan, items, own_rows.long(), query_start, key_start,
                                    int(max(np.diff(group_starts)))))
        rows.step_plans[key] = groups
    return rows.step_plans[key]


def dense_prompt(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                 fmt: KVPageFormat | SalientTokensFormat, rows: TokenRows, sm_scale: float, out: torch.Tensor,
                 window: int | None = None) -> torch.Tensor:
    """The history route of a step where some chunk has history (``prompt_chunks``, and ZipCache's
    ``salient_prompt``): the attention into ``out``; returns each row's natural log-sum-exp over its
    whole context [Hq, T] (float32)."""
    lses = []
    for group in step_groups(rows, fmt.block_size, window, kv_row_bytes(key), cache.device):
        rows_of = group.tokens
        k, v = history_rows(cache, fmt, rows.block_table[rows_of], group.plan, group.items, key.dtype)
        k.index_copy_(0, group.own_rows, key[rows_of])
        v.index_copy_(0, group.own_rows, value[rows_of])
        lses.append(chunks_attention(query[rows_of], k, v, group.query_start, group.max_query_len, group.key_start,
                                     group.plan.max_key_len, sm_scale, out[rows_of], window))
    return lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)  # the groups cover the step's rows in order


def warm_up(cache: torch.Tensor, fmt: KVPageFormat, num_query_heads: int, query_dtype: torch.dtype,
            window: int | None = None) -> None:
    """Compile both routes a step may take: the history kernel (``warm_up_rows``) and the decode
    kernel's prompt variants (``decode.warm_up``)."""
    warm_up_rows(cache, fmt, query_dtype)
    decode_warm_up(cache, fmt, num_query_heads, query_dtype, window)


def warm_up_rows(cache: torch.Tensor, fmt: KVPageFormat | SalientTokensFormat, dtype: torch.dtype) -> None:
    """Compile the history kernel for this page format: one page of block 0 into throwaway rows."""
    plan = HistoryPlan([0, 1], [1], fmt.block_size, None)
    table = torch.zeros(1, 1, dtype=torch.int32, device=cache.device)
    items = torch.tensor(plan.items.ravel(), dtype=torch.int32, device=cache.device)
    history_rows(cache, fmt, table, plan, items, dtype)
