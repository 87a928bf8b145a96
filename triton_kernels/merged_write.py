"""MiniCache's write on the GPU: a pair's new tokens into their shared pages, as
``MergedPairFormat.append`` writes them.

The merge itself (norms, SLERP of the directions, each token's distance) is one kernel over the
step's tokens (``pair_merge``). The merged directions then go through the layer write kernel
(``write.write_tokens``): the pair page begins with a layer page's codes, so the codecs' append rule
is the layer pages' own. ``_retain_kernel`` writes the norms and updates the retention slots: the
program of a block's first new token of the step walks the block's new tokens in order, writes
their norms and keeps the most distinct of the held and new tokens (a new token replaces the
weakest held one where it is strictly more distinct: ties go to the earlier token, as in the
reference); then it marks the retained tokens' norms negated and restores the evicted ones'.
Without retention slots each token's program writes its own norms. No step waits on the host.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats.merged import MergedPairFormat

from .launch import Variant, launch
from .pair_merge import merge_pair
from .write import warm_up as warm_up_layer_write
from .write import write_tokens

_COPY = 1024  # elements of a retained token's vectors copied at a time


@triton.jit
def _store_norms(page, NORMS: tl.constexpr, offset, norms, e, NH: tl.constexpr, B: tl.constexpr, SIGN: tl.constexpr):
    """A token's norms [2 layers, 2 (K, V), H] (``e`` < NH of them) at ``offset`` of the page's norms
    [2, 2, H, B], the sign bit set (SIGN 1: a retained token) or cleared (0)."""
    bits = norms.to(tl.int16, bitcast=True)
    bits = (bits | -32768) if SIGN else (bits & 0x7FFF)
    tl.store((page + NORMS).to(tl.pointer_type(tl.float16)) + e * B + offset, bits.to(tl.float16, bitcast=True),
             mask=e < NH)


@triton.jit
def _load_norms(page, NORMS: tl.constexpr, offset, e, NH: tl.constexpr, B: tl.constexpr):
    return tl.load((page + NORMS).to(tl.pointer_type(tl.float16)) + e * B + offset, mask=e < NH, other=0.0)


@triton.jit(do_not_specialize=["n"])  # the step's token count: no compile in the middle of serving
def _retain_kernel(slot_ptr, n, distance_ptr, norms_ptr, x_ptr, cache_ptr, PAGE: tl.constexpr, B: tl.constexpr,
                   R: tl.constexpr, RP: tl.constexpr, NH: tl.constexpr, NHP: tl.constexpr, X: tl.constexpr,
                   COPY: tl.constexpr, NORMS: tl.constexpr, INDEX: tl.constexpr, DISTANCE: tl.constexpr,
                   KEPT: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i)
    e = tl.arange(0, NHP)  # a token's norms [2 layers, 2 (K, V), H]: NH values
    if slot >= 0:
        block = slot // B
        page = cache_ptr + block.to(tl.int64) * PAGE
        if R == 0:
            _store_norms(page, NORMS, slot % B, tl.load(norms_ptr + i * NH + e, mask=e < NH), e, NH, B, 0)
        else:
            before = tl.load(slot_ptr + i - 1, mask=i > 0, other=-1)
            if (before < 0) | (before // B != block):  # the block's first new token of the step walks them all
                r = tl.arange(0, RP)
                first = slot % B  # tokens the block held before the step
                index = tl.load((page + INDEX).to(tl.pointer_type(tl.int16)) + r, mask=r < R, other=-1).to(tl.int32)
                held = (index >= 0) & (index < first)  # a reused page's slots hold nothing yet
                index = tl.where(held, index, -1)
                was = index
                dist = tl.where(held, tl.load((page + DISTANCE).to(tl.pointer_type(tl.float32)) + r, mask=r < R,
                                              other=-1.0), -1.0)
                dist = tl.where(r < R, dist, float("inf"))  # padding slots are never the weakest
                kept = (page + KEPT).to(x_ptr.dtype)
                j = i
                at = slot
                while (at >= 0) & (at // B == block):
                    _store_norms(page, NORMS, at % B, tl.load(norms_ptr + j * NH + e, mask=e < NH), e, NH, B, 0)
                    d = tl.load(distance_ptr + j)
                    weakest = tl.min(dist, 0)
                    # the weakest held token: least distinct, the latest of equals (a free slot first)
                    latest = tl.max(tl.where(dist == weakest, index, -2), 0)
                    w = tl.min(tl.where((dist == weakest) & (index == latest), r, RP), 0)
                    if d > weakest:
                        index = tl.where(r == w, (at % B).to(tl.int32), index)
                        dist = tl.where(r == w, d, dist)
                        for c in range(0, X, COPY):
                            o = c + tl.arange(0, COPY)
                            tl.store(kept + w * X + o, tl.load(x_ptr + j.to(tl.int64) * X + o, mask=o < X),
                                     mask=o < X)
                    j += 1
                    at = tl.load(slot_ptr + j, mask=j < n, other=-1)
                tl.store((page + INDEX).to(tl.pointer_type(tl.int16)) + r, index.to(tl.int16), mask=r < R)
                tl.store((page + DISTANCE).to(tl.pointer_type(tl.float32)) + r, dist, mask=r < R)
                tl.debug_barrier()  # the new tokens' norms are stored before their signs are set
                for k in tl.static_range(R):  # a retained token's norms negated, an evicted one's restored
                    old = tl.sum(tl.where(r == k, was, 0), 0)
                    if (old >= 0) & (tl.sum((index == old).to(tl.int32), 0) == 0):
                        _store_norms(page, NORMS, old, _load_norms(page, NORMS, old, e, NH, B), e, NH, B, 0)
                    now = tl.sum(tl.where(r == k, index, 0), 0)
                    if now >= 0:
                        _store_norms(page, NORMS, now, _load_norms(page, NORMS, now, e, NH, B), e, NH, B, 1)


def write_pair_tokens(cache: torch.Tensor, fmt: MergedPairFormat, key_a: torch.Tensor, value_a: torch.Tensor,
                      key_b: torch.Tensor, value_b: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as ``paged_torch.write_pair_tokens``: two layers' new tokens [N, H, D] at
    ``slot_mapping`` (-1: none; a block's new tokens consecutive and in order, as vLLM lays a step's)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    x, merged, norms, distance = merge_pair(fmt, key_a, value_a, key_b, value_b)
    write_tokens(cache, fmt.directions, merged[:, 0], merged[:, 1], slot_mapping, page_bytes=fmt.page_bytes)
    launch(retain_variant(fmt), (n,), (slot_mapping, n, distance, norms, x, cache))


@functools.cache  # one Variant a format: launch keeps its compiled kernel by it
def retain_variant(fmt: MergedPairFormat) -> Variant:
    """``_retain_kernel`` for ``fmt``'s pages."""
    at = fmt.regions.start
    nh, x = 2 * 2 * fmt.k.num_heads, 2 * 2 * fmt.k.num_heads * fmt.k.head_size  # a token's norms and vectors
    return Variant(_retain_kernel, dict(
        PAGE=fmt.page_bytes, B=fmt.block_size, R=fmt.retained, RP=triton.next_power_of_2(max(fmt.retained, 2)),
        NH=nh, NHP=triton.next_power_of_2(nh), X=x, COPY=min(_COPY, triton.next_power_of_2(x)),
        NORMS=at("norms"), INDEX=at("index"), DISTANCE=at("distance"), KEPT=at("kept")), {"num_warps": 4})


def warm_up(cache: torch.Tensor, fmt: MergedPairFormat, dtype: torch.dtype) -> None:
    """Compile what a pair's write launches (the merge, both variants of the layer write, the
    retention kernel) before serving. One token with no slot (-1): nothing is written."""
    warm_up_layer_write(cache, fmt.directions, dtype, page_bytes=fmt.page_bytes)
    x = torch.zeros(1, fmt.k.num_heads, fmt.k.head_size, dtype=dtype, device=cache.device)
    write_pair_tokens(cache, fmt, x, x, x, x, torch.full((1,), -1, dtype=torch.int64, device=cache.device))
