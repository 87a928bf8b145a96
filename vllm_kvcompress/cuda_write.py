"""The cache write as a CUDA kernel (``csrc/write_kernel.cu``), built just in time with nvcc
through ``torch.utils.cpp_extension`` (cached by torch under ``TORCH_EXTENSIONS_DIR``) and called
through ctypes, so the build includes no torch headers.

Same contract and bytes as ``paged_torch.write_tokens``. It covers 2-, 4- and 8-bit K and V with
statistics per channel (append rule) or per token, head sizes 64, 128 and 256; the kernel registry
(``kernels.registry``) says why not for the rest (3 bits, ZipCache channel scales, 16-bit tensors,
the KVmix recent window), which the Triton kernel writes, and gives it every format it covers
where nvcc or the prebuilt kernels exist unless ``KVCOMPRESS_WRITE=triton`` (``docs/gpu.md`` has the timings).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from vllm_kvcompress.formats import KVPageFormat

from . import cuda_jit
from .launch_plans import LaunchPlans
from .formats.layout import page_layout

class _TensorArgs(ctypes.Structure):
    """``csrc/write_kernel.cu``'s Tensor: a source [N, H, head_size] and its page layout."""
    _fields_ = [("src", ctypes.c_void_p), ("src_stride", ctypes.c_int64)] + [
        (name, ctypes.c_int) for name in ("codes", "row_bytes", "scale", "zero", "token_group")]


class _WriteArgs(ctypes.Structure):
    """``csrc/write_kernel.cu``'s WriteArgs, field for field."""
    _fields_ = [("num_tensors", ctypes.c_int), ("a", _TensorArgs), ("b", _TensorArgs), ("slots", ctypes.c_void_p),
                ("cache", ctypes.c_void_p), ("num_tokens", ctypes.c_int), ("num_heads", ctypes.c_int),
                ("head_size", ctypes.c_int), ("page_bytes", ctypes.c_int64), ("block_size", ctypes.c_int),
                ("bits", ctypes.c_int), ("dtype", ctypes.c_int), ("stream", ctypes.c_void_p)]


_kernel = cuda_jit.Kernel("kvcompress_write", "kvc_write", _WriteArgs, "KVCOMPRESS_WRITE",
                           "CUDA write kernel")
build = _kernel.build  # at startup, not in the middle of serving


_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@functools.cache
def _launches(fmt: KVPageFormat) -> tuple[tuple, ...]:
    """The format's launches, each (tensors, first source, its layout, second source, its layout,
    bits): source 0 is the key, 1 the value; a layout is ``_TensorArgs``' (codes, row bytes, scale,
    zero, token group: 0 where statistics are per channel). K and V of one width go in one launch."""
    lay = page_layout(fmt)
    k = (0, (lay.k.codes, lay.k.row_bytes, lay.k.scale, lay.k.zero, lay.k.token_group))
    if fmt.v is None:  # K-only pages
        return ((1, *k, *k, lay.k.bits),)
    v = (1, (lay.v.codes, lay.v.row_bytes, lay.v.scale, lay.v.zero, lay.v.token_group))
    if lay.k.bits == lay.v.bits:
        return ((2, *k, *v, lay.k.bits),)
    return ((1, *k, *k, lay.k.bits), (1, *v, *v, lay.v.bits))


def _source(src: torch.Tensor) -> tuple[int, int]:
    if src.stride(2) != 1 or src.stride(1) != src.shape[2]:
        raise ValueError(f"CUDA write: sources [N, H, D] with contiguous heads and channels, got strides {src.stride()}")
    return src.data_ptr(), src.stride(0)


_plans = LaunchPlans()  # by step: slots and format (the arguments but sources and cache)


def _plan(fmt: KVPageFormat, slots: torch.Tensor, dtype: torch.dtype, stream: int) -> tuple:
    """Each launch's arguments but for its sources and cache, with the indices of its two sources."""
    plan = []
    for count, a, a_layout, b, b_layout, bits in _launches(fmt):
        args = _WriteArgs(num_tensors=count, a=_TensorArgs(0, 0, *a_layout), b=_TensorArgs(0, 0, *b_layout),
                          slots=slots.data_ptr(), num_tokens=slots.shape[0], num_heads=fmt.k.num_heads,
                          head_size=fmt.k.head_size, page_bytes=fmt.page_bytes, block_size=fmt.block_size, bits=bits,
                          dtype=_DTYPES[dtype], stream=stream)
        plan.append((args, a, b))
    return tuple(plan)


def write_tokens(cache: torch.Tensor, fmt: KVPageFormat, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Same contract as ``paged_torch.write_tokens``, for the formats the registry gives this kernel."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    slots = slot_mapping.long()
    stream = cuda_jit.triton_kernels("launch").stream_handle(cache.device)
    plan_key = (fmt, slots.data_ptr(), n, key.dtype, stream)
    plan = _plans.get(plan_key, lambda: _plan(fmt, slots, key.dtype, stream))
    sources, cache_ptr = (_source(key), _source(value)), cache.data_ptr()
    for args, a, b in plan:
        args.a.src, args.a.src_stride = sources[a]
        args.b.src, args.b.src_stride = sources[b]
        args.cache = cache_ptr
        _kernel(args)
