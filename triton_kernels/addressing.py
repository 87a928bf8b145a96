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
