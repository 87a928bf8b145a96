"""Where a code lies in a page, for the Triton kernels that read and write them (kept apart from
``layout``, which the backend imports at startup without Triton)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def code_unit_ptr(page, CODES: tl.constexpr, t, h, u, ROW: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                  TOKEN_MAJOR: tl.constexpr):
    """Address of storage unit ``u`` (a byte, or a 32-bit word for 3 bits) of token ``t``'s codes of
    head ``h``, in a page's codes region at ``CODES`` of ``ROW`` bytes a row (``MinMaxCodec``):
    head-major rows ``[H, B, units]`` where statistics are per channel, in groups of G tokens
    unit-major within a group ``[H, B / G, units, G]`` where they are per token (``TOKEN_MAJOR``;
    G is ``MinMaxCodec.token_group``)."""
    UB: tl.constexpr = 4 if BITS == 3 else 1
    if TOKEN_MAJOR:
        G: tl.constexpr = 32 if (BITS == 2 or BITS == 4) and BLOCK % 32 == 0 else BLOCK
        return page + CODES + (((h * (BLOCK // G) + t // G) * (ROW // UB) + u) * G + t % G) * UB
    else:
        return page + CODES + (h * BLOCK + t) * ROW + u * UB
