"""Where a code lies in a page, for the Triton kernels that read and write them (kept apart from
``layout``, which the backend imports at startup without Triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def code_unit_ptr(page, CODES: tl.constexpr, t, h, u, ROW: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                  GROUP: tl.constexpr):
    """Address of storage unit ``u`` (a byte, or a 32-bit word for 3 bits) of token ``t``'s codes of
    head ``h``, in a page's codes region at ``CODES`` of ``ROW`` bytes a row (``MinMaxCodec``):
    head-major rows ``[H, B, units]`` where statistics are per channel (``GROUP`` 0), in groups of
    ``GROUP`` tokens unit-major within a group ``[H, B / GROUP, units, GROUP]`` where they are per
    token (``TensorLayout.token_group``)."""
    UB: tl.constexpr = 4 if BITS == 3 else 1
    if GROUP > 0:
        return page + CODES + (((h * (BLOCK // GROUP) + t // GROUP) * (ROW // UB) + u) * GROUP + t % GROUP) * UB
    else:
        return page + CODES + (h * BLOCK + t) * ROW + u * UB


@triton.jit
def code_grid(p, BITS: tl.constexpr):
    """For position ``p`` inside a storage unit: the code's bit width, its highest code, its step
    over the scale, and its shift in the unit. 3 bits: position 10 of each word is a 2-bit code on
    a grid 7/3 as coarse (see ``packing``)."""
    if BITS == 3:
        width = tl.where(p == 10, 2, 3)
        top = tl.where(p == 10, 3.0, 7.0)
        ratio = tl.where(p == 10, 7.0 / 3.0, 1.0)
    else:
        width = BITS + p * 0
        top = (1 << BITS) - 1.0 + p * 0.0
        ratio = 1.0 + p * 0.0
    # padded positions (11..15 of a 3-bit word) must still shift by less than 32: a wider shift is
    # undefined on the GPU and poisons the packed word even where the value is masked off
    return width, top, ratio, (tl.where(p <= 10, p * 3, 0) if BITS == 3 else p * BITS)


@triton.jit
def load_units(ptr, mask, BITS: tl.constexpr):
    """Storage units at ``ptr`` (``code_unit_ptr``) as int32."""
    if BITS == 3:
        return tl.load(ptr.to(tl.pointer_type(tl.int32)), mask=mask, other=0)
    else:
        return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def unpack_codes(units, width, shift):
    """The codes (float32) at ``shift`` of ``width`` bits (``code_grid``) in int32 ``units``."""
    return ((units >> shift) & ((1 << width) - 1)).to(tl.float32)
