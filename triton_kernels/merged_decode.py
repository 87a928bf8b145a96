"""Decode attention straight from MiniCache's pages (``formats.merged``): one layer of a merged pair,
restored in registers, never written out.

One program per (request, KV head) reads its request's pages once for all the query heads of that
KV head (or per group of a prompt chunk's tokens, which all read the same history: ``token_rows``).
Per tile of tokens it dequantizes the shared directions through the pair's codec (raw 16-bit values,
or min-max codes with statistics per channel or per token) and scales each token's K and V to the
layer's own norm: ``x / |x| * norm``, as ``MergedPairFormat.decode``. A block's retained tokens are
masked out of its tiles and read, exact, from the block's retention slots after them. Besides
the output it writes each row's log-sum-exp, so that the caller can merge what the pages do not hold
yet (the step's own tokens: a pair's pages take them after both layers' attention).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats.layout import page_layout
from vllm_kvcompress.formats.merged import MergedPairFormat
from vllm_kvcompress.paged_torch import with_own_token
from vllm_kvcompress.token_rows import TokenGroups

from .addressing import code_grid, code_unit_ptr, load_units, unpack_codes
from .history_rows import history_outputs, online_softmax_step, program_rows, store_rows

_EPS = tl.constexpr(1e-6)  # as MergedPairFormat's restoration


@triton.jit
def _restored(page, raw, t, valid, h, d, KV: tl.constexpr, LAYER: tl.constexpr, BITS: tl.constexpr, CODES: tl.constexpr,
              ROW: tl.constexpr, SCALE: tl.constexpr, ZERO: tl.constexpr, GROUP: tl.constexpr, NORMS: tl.constexpr,
              B: tl.constexpr, H: tl.constexpr, D: tl.constexpr):
    """Layer LAYER's K (KV 0) or V (KV 1) [T, D] (float32) of tokens ``t`` (offsets in the block) of
    head ``h``: the merged direction, dequantized, times the layer's norm over the direction's own.
    ``raw``: any pointer to the model dtype (the raw values')."""
    m = valid[:, None]
    if BITS == 16:  # raw values in the model dtype (the query's), token-major rows [B, H, D]
        rows = page + CODES + (t[:, None] * H + h) * ROW
        x = tl.load(rows.to(tl.pointer_type(raw.dtype.element_ty)) + d[None, :], mask=m, other=0.0).to(tl.float32)
    else:  # 2, 4 or 8 bits: a byte's codes, channel d at position d % (8 // BITS)
        PER: tl.constexpr = 8 // BITS
        width, _, _, shift = code_grid(d[None, :] % PER, BITS)
        codes = unpack_codes(load_units(code_unit_ptr(page, CODES, t[:, None], h, d[None, :] // PER, ROW, B, BITS,
                                                      GROUP), m, BITS), width, shift)
        half = tl.pointer_type(tl.float16)
        if GROUP > 0:  # statistics per token, head-major [H, B]
            scale = tl.load((page + SCALE).to(half) + h * B + t, mask=valid, other=0.0).to(tl.float32)[:, None]
            zero = tl.load((page + ZERO).to(half) + h * B + t, mask=valid, other=0.0).to(tl.float32)[:, None]
        else:  # per channel [H, D]
            scale = tl.load((page + SCALE).to(half) + h * D + d).to(tl.float32)[None, :]
            zero = tl.load((page + ZERO).to(half) + h * D + d).to(tl.float32)[None, :]
        x = codes * scale + zero
    norm = tl.load((page + NORMS).to(tl.pointer_type(tl.float16)) + ((t * 2 + LAYER) * 2 + KV) * H + h, mask=valid,
                   other=0.0).to(tl.float32)
    length = tl.sqrt(tl.sum(x * x, 1))
    return x * (norm / tl.maximum(length, _EPS))[:, None]


@triton.jit
def _merged_decode_kernel(q_ptr, pages_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr, group_rows_ptr, group_starts_ptr,
                          scale, q_row_stride, q_head_stride, table_stride, out_row_stride, out_head_stride,
                          lse_row_stride, PAGE: tl.constexpr, B: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                          G: tl.constexpr, MP: tl.constexpr, GROUPED: tl.constexpr, TILE: tl.constexpr,
                          LAYER: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, K_BITS: tl.constexpr,
                          K_CODES: tl.constexpr, K_ROW: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
                          K_GROUP: tl.constexpr, V_BITS: tl.constexpr, V_CODES: tl.constexpr, V_ROW: tl.constexpr,
                          V_SCALE: tl.constexpr, V_ZERO: tl.constexpr, V_GROUP: tl.constexpr, NORMS: tl.constexpr,
                          INDEX: tl.constexpr, KEPT: tl.constexpr):
    row, length, token, head, live, q = program_rows(q_ptr, lens_ptr, group_rows_ptr, group_starts_ptr, scale,
                                                     q_row_stride, q_head_stride, G, MP, D, GROUPED)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.zeros([MP], tl.float32)
    acc = tl.zeros([MP, D], tl.float32)
    r = tl.arange(0, RP)
    raw = tl.pointer_type(q_ptr.dtype.element_ty)
    for start in range(0, length, B):  # a block at a time: its merged tokens, then its retained ones
        page = pages_ptr + tl.load(table_ptr + row * table_stride + start // B).to(tl.int64) * PAGE
        kept_at = tl.load((page + INDEX).to(tl.pointer_type(tl.int16)) + r, mask=r < R, other=-1).to(tl.int32)
        for tile in range(start, tl.minimum(start + B, length), TILE):
            t = tile % B + tl.arange(0, TILE)
            valid = tile + tl.arange(0, TILE) < length
            if R > 0:  # retained tokens are read from their slots below
                valid = valid & (tl.sum((t[:, None] == kept_at[None, :]).to(tl.int32), 1) == 0)
            k = _restored(page, q_ptr, t, valid, h, d, 0, LAYER, K_BITS, K_CODES, K_ROW, K_SCALE, K_ZERO, K_GROUP,
                          NORMS, B, H, D)
            v = _restored(page, q_ptr, t, valid, h, d, 1, LAYER, V_BITS, V_CODES, V_ROW, V_SCALE, V_ZERO, V_GROUP,
                          NORMS, B, H, D)
            m_i, l_i, acc = online_softmax_step(q, k, v, valid, m_i, l_i, acc)
        if R > 0:  # exact, from the slots [R, 2 layers, 2 (K, V), H, D]
            valid = (kept_at >= 0) & (start + kept_at < length)
            kept = (page + KEPT).to(raw) + ((r[:, None] * 2 + LAYER) * 2 * H + h) * D + d[None, :]
            k = tl.load(kept, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(kept + H * D, mask=valid[:, None], other=0.0).to(tl.float32)
            m_i, l_i, acc = online_softmax_step(q, k, v, valid, m_i, l_i, acc)
    store_rows(out_ptr, lse_ptr, acc, m_i, l_i, token, head, live, out_row_stride, out_head_stride, lse_row_stride, D)


def _codes_constants(fmt: MergedPairFormat) -> dict:
    """K's and V's code regions, as the layer page the pair page begins with lays them out."""
    lay = page_layout(fmt.directions)
    return {f"{name}_{field}": value for name, t in (("K", lay.k), ("V", lay.v))
            for field, value in (("BITS", t.bits), ("CODES", t.codes), ("ROW", t.row_bytes), ("SCALE", t.scale),
                                 ("ZERO", t.zero), ("GROUP", t.token_group))}


@functools.cache  # read at every launch
def decode_constants(fmt: MergedPairFormat, layer: int, group: int, rows_per_program: int, grouped: bool) -> dict:
    """The decode kernel's compile-time constants for ``layer`` of ``fmt``'s pairs, ``group`` query
    heads a KV head and ``rows_per_program`` tokens a program."""
    at = fmt.regions.start
    return dict(PAGE=fmt.page_bytes, B=fmt.block_size, H=fmt.k.num_heads, D=fmt.k.head_size, G=group,
                MP=max(16, triton.next_power_of_2(rows_per_program * group)), GROUPED=grouped,
                TILE=min(64, fmt.block_size), LAYER=layer, R=fmt.retained,
                RP=max(16, triton.next_power_of_2(fmt.retained)), **_codes_constants(fmt), NORMS=at("norms"),
                INDEX=at("index"), KEPT=at("kept"))


def merged_decode(q: torch.Tensor, pages: torch.Tensor, fmt: MergedPairFormat, layer: int, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                  groups: TokenGroups | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows ``q`` [N, Hq, D] of the pair's layer ``layer`` (0: its first), each over its
    ``seq_lens`` tokens in ``pages`` [num_blocks, page_bytes] by its row of ``block_table``; with
    ``groups`` (``token_rows``), the rows of a group share them and one program takes the group.
    Returns the output [N, Hq, D] and each row's log-sum-exp [N, Hq] (a row of no tokens: 0 and -inf)."""
    n, hq, _ = q.shape
    if q.dtype != fmt.dtype:
        raise ValueError(f"queries in {q.dtype}, pages of {fmt.dtype}: the kernel reads raw values as the queries' dtype")
    heads = fmt.k.num_heads
    group = hq // heads
    out, lse = history_outputs(q, out)
    if n == 0:
        return out, lse
    size = 1 if groups is None else groups.size
    _merged_decode_kernel[(n if groups is None else groups.starts.shape[0], heads)](
        q, pages, block_table, seq_lens, out, lse, None if groups is None else groups.rows,
        None if groups is None else groups.starts, scale, q.stride(0), q.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), num_warps=4,
        **decode_constants(fmt, layer, group, size, groups is not None))
    return out, lse


def decode_rows(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor, fmt: MergedPairFormat,
                layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Decode rows (one new token each, ``q`` [N, Hq, D], ``key``/``value`` [N, H, D]) as
    ``paged_torch.attend_pair`` computes them: the context before the new token from the pages,
    merged with the new token's own exact term (the pages take it after the pair's second layer)."""
    earlier, earlier_lse = merged_decode(q, pages, fmt, layer, block_table, seq_lens - 1, scale)
    with_own_token(q, key, value, earlier, earlier_lse, scale, out)
