"""The codecs' min-max grid in Triton (``codecs.min_max_grid``, ``codecs.codes_on``), for the kernels
that code values: rounding as the torch reference's, IEEE division."""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_kvcompress.formats.codecs import EPS

_EPS = tl.constexpr(EPS)


@triton.jit
def code_on(x, zero, step):
    """Unclamped code of ``x`` on the grid ``zero + k * step``, rounded half up as the reference."""
    return tl.floor(tl.math.div_rn(x - zero, step + tl.zeros_like(x)) + 0.5)


@triton.jit
def min_max_stats(lo, hi, FULL_TOP: tl.constexpr):
    """float16 (zero, scale) of the grid spanning ``lo .. hi`` with codes 0..FULL_TOP."""
    zero = lo.to(tl.float16)
    scale = tl.maximum(tl.math.div_rn(hi - zero.to(tl.float32), FULL_TOP + tl.zeros_like(hi)), _EPS).to(tl.float16)
    return zero, scale
