"""Where a code lies in a page, for the Triton kernels that read and write them (kept apart from
``layout``, which the backend imports at startup without Triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def code_unit_ptr(page, CODES: tl.constexpr, t, h, u, ROW: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Address of byte ``u`` of token ``t``'s codes of head ``h``, in a page's codes region at
    ``CODES`` of ``ROW`` bytes a row (``MinMaxCodec``): head-major rows ``[H, B, ROW]`` where
    statistics are per channel (``GROUP`` 0), in groups of ``GROUP`` tokens byte-major within a
    group ``[H, B / GROUP, ROW, GROUP]`` where they are per token (``TensorLayout.token_group``)."""
    if GROUP > 0:
        return page + CODES + ((h * (BLOCK // GROUP) + t // GROUP) * ROW + u) * GROUP + t % GROUP
    else:
        return page + CODES + (h * BLOCK + t) * ROW + u


# The write kernels see a row as storage units of VALS channels: a byte of 8 // bits codes at 2, 4
# and 8 bits; at 3 bits (two planes, ``packing``) the 8 channels 8u..8u+7, whose low bits are bytes
# 2u and 2u + 1 of the 2-bit plane and whose high bits are byte u of the 1-bit plane, held in
# registers as one int32 (low bits in bits 0..15, high bits in 16..23; ``write._geometry``).


@triton.jit
def load_units(page, CODES: tl.constexpr, t, h, u, ROW: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
               GROUP: tl.constexpr, mask):
    """Storage units ``u`` of tokens ``t`` as int32 (0 where not ``mask``)."""
    if BITS == 3:
        lo0 = tl.load(code_unit_ptr(page, CODES, t, h, 2 * u, ROW, BLOCK, GROUP), mask=mask, other=0)
        lo1 = tl.load(code_unit_ptr(page, CODES, t, h, 2 * u + 1, ROW, BLOCK, GROUP), mask=mask, other=0)
        hi = tl.load(code_unit_ptr(page, CODES, t, h, ROW * 2 // 3 + u, ROW, BLOCK, GROUP), mask=mask, other=0)
        return lo0.to(tl.int32) | (lo1.to(tl.int32) << 8) | (hi.to(tl.int32) << 16)
    else:
        return tl.load(code_unit_ptr(page, CODES, t, h, u, ROW, BLOCK, GROUP), mask=mask, other=0).to(tl.int32)


@triton.jit
def store_units(page, CODES: tl.constexpr, t, h, u, ROW: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                GROUP: tl.constexpr, packed, mask):
    """Store int32 storage units ``packed`` (``pack_units``) as ``u`` of tokens ``t``."""
    if BITS == 3:
        tl.store(code_unit_ptr(page, CODES, t, h, 2 * u, ROW, BLOCK, GROUP), (packed & 0xFF).to(tl.uint8), mask=mask)
        tl.store(code_unit_ptr(page, CODES, t, h, 2 * u + 1, ROW, BLOCK, GROUP), ((packed >> 8) & 0xFF).to(tl.uint8),
                 mask=mask)
        tl.store(code_unit_ptr(page, CODES, t, h, ROW * 2 // 3 + u, ROW, BLOCK, GROUP),
                 ((packed >> 16) & 0xFF).to(tl.uint8), mask=mask)
    else:
        tl.store(code_unit_ptr(page, CODES, t, h, u, ROW, BLOCK, GROUP), packed.to(tl.uint8), mask=mask)


@triton.jit
def unpack_codes(units, p, BITS: tl.constexpr):
    """The codes (float32) at position ``p`` of int32 storage units (``load_units``)."""
    if BITS == 3:
        return (((units >> (2 * p)) & 3) | (((units >> (16 + p)) & 1) << 2)).to(tl.float32)
    else:
        return ((units >> (p * BITS)) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def pack_units(codes, p, AXIS: tl.constexpr, BITS: tl.constexpr):
    """Integer codes (uint32, at positions ``p``) summed over axis AXIS into int32 storage units."""
    if BITS == 3:
        return tl.sum(((codes & 3) << (2 * p).to(tl.uint32)) | ((codes >> 2) << (16 + p).to(tl.uint32)), AXIS)
    else:
        return tl.sum(codes << (p * BITS).to(tl.uint32), AXIS)
