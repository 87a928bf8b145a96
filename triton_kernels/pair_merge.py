"""MiniCache's merge of a pair's new tokens on the GPU, as ``MergedPairFormat.merge`` computes it, in
one kernel: in torch it is some thirty small kernels a step and pair (H200, 144 decode rows of the
Llama-2-7B shape: 355 us, most of the pair's write; docs/benchmarks.md).

One program per token: for K, then V, both layers' vectors of every head, their norms (stored in
float16; the directions divide by the stored value, as the reference), the SLERP of the directions
and the angle between them, averaged over heads and over K and V (the token's distance).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_kvcompress.formats.merged import NORM_EPS, SLERP_NEAR, MergedPairFormat

from .launch import Variant, launch

_EPS = tl.constexpr(NORM_EPS)
_NEAR = tl.constexpr(SLERP_NEAR)


@triton.jit
def _arccos(x):
    """arccos on [-1, 1] to within 2e-8 (Abramowitz and Stegun 4.4.46); Triton's own runs only on
    the GPU, not in its interpreter."""
    a = tl.abs(x)
    p = -0.0012624911
    p = p * a + 0.0066700901
    p = p * a - 0.0170881256
    p = p * a + 0.0308918810
    p = p * a - 0.0501743046
    p = p * a + 0.0889789874
    p = p * a - 0.2145988016
    p = p * a + 1.5707963050
    r = tl.sqrt(1.0 - a) * p
    return tl.where(x < 0, 3.141592653589793 - r, r)


@triton.jit
def _merge_kernel(ka_ptr, va_ptr, kb_ptr, vb_ptr, x_ptr, merged_ptr, norms_ptr, distance_ptr, ka_stride, va_stride,
                  kb_stride, vb_stride, t, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr):
    """Token program_id(0): ``x`` [2 layers, 2 (K, V), H, D] (the vectors as given), ``merged``
    [2, H, D], ``norms`` [2 layers, 2, H] float16 and ``distance`` (float32)."""
    i = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)[:, None]
    d = tl.arange(0, D)[None, :]
    m = h < H
    at = h * D + d
    angle = tl.zeros([HP], tl.float32)
    for kv in tl.static_range(2):
        if kv == 0:
            xa = tl.load(ka_ptr + i * ka_stride + at, mask=m, other=0.0)
            xb = tl.load(kb_ptr + i * kb_stride + at, mask=m, other=0.0)
        else:
            xa = tl.load(va_ptr + i * va_stride + at, mask=m, other=0.0)
            xb = tl.load(vb_ptr + i * vb_stride + at, mask=m, other=0.0)
        tl.store(x_ptr + (i * 4 + kv) * H * D + at, xa.to(x_ptr.dtype.element_ty), mask=m)
        tl.store(x_ptr + (i * 4 + 2 + kv) * H * D + at, xb.to(x_ptr.dtype.element_ty), mask=m)
        xa = xa.to(tl.float32)
        xb = xb.to(tl.float32)
        na = tl.sqrt(tl.sum(xa * xa, 1)).to(tl.float16)
        nb = tl.sqrt(tl.sum(xb * xb, 1)).to(tl.float16)
        hh = tl.arange(0, HP)
        tl.store(norms_ptr + (i * 4 + kv) * H + hh, na, mask=hh < H)
        tl.store(norms_ptr + (i * 4 + 2 + kv) * H + hh, nb, mask=hh < H)
        ua = xa / tl.maximum(na.to(tl.float32), _EPS)[:, None]
        ub = xb / tl.maximum(nb.to(tl.float32), _EPS)[:, None]
        cos = tl.minimum(tl.maximum(tl.sum(ua * ub, 1), -1.0), 1.0)
        omega = _arccos(cos)
        sin = tl.sin(omega)
        near = sin < _NEAR
        safe = tl.maximum(sin, _NEAR)
        wa = tl.where(near, 1.0 - t, tl.sin((1.0 - t) * omega) / safe)
        wb = tl.where(near, t, tl.sin(t * omega) / safe)
        merged = wa[:, None] * ua + wb[:, None] * ub
        tl.store(merged_ptr + (i * 2 + kv) * H * D + at, merged.to(merged_ptr.dtype.element_ty), mask=m)
        angle += tl.where(hh < H, omega, 0.0)
    tl.store(distance_ptr + i, tl.sum(angle, 0) / (2 * H))


def merge_pair(fmt: MergedPairFormat, ka: torch.Tensor, va: torch.Tensor, kb: torch.Tensor,
               vb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``MergedPairFormat.merge`` of tokens [N, H, D] (heads and channels contiguous within a row): the
    vectors [N, 2, 2, H, D] in the model dtype, the merged directions [N, 2, H, D] in the model dtype,
    the norms [N, 2, 2, H] float16 and the distances [N] float32."""
    n, heads, d = ka.shape
    if any(t.stride(1) != d or t.stride(2) != 1 for t in (ka, va, kb, vb)):
        raise ValueError("key, value: heads and channels contiguous within a row")
    dev = ka.device
    x = torch.empty(n, 2, 2, heads, d, dtype=fmt.dtype, device=dev)
    merged = torch.empty(n, 2, heads, d, dtype=fmt.dtype, device=dev)
    norms = torch.empty(n, 2, 2, heads, dtype=torch.float16, device=dev)
    distance = torch.empty(n, dtype=torch.float32, device=dev)
    if n:
        launch(_variant(heads, d), (n,), (ka, va, kb, vb, x, merged, norms, distance, ka.stride(0), va.stride(0),
                                         kb.stride(0), vb.stride(0), fmt.t))
    return x, merged, norms, distance


@functools.cache  # one Variant a shape: launch keeps its compiled kernel by it
def _variant(heads: int, head_size: int) -> Variant:
    return Variant(_merge_kernel, dict(H=heads, HP=triton.next_power_of_2(heads), D=head_size),
                   {"num_warps": 8 if heads * head_size >= 2048 else 4})
