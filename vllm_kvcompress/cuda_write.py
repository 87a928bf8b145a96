"""The cache write as a CUDA kernel (``csrc/write_kernel.cu``), built just in time with nvcc
through ``torch.utils.cpp_extension`` (cached by torch under ``TORCH_EXTENSIONS_DIR``) and called
through ctypes, so the build includes no torch headers.

Same contract and bytes as ``paged_torch.write_tokens``. It covers 2-, 4- and 8-bit K and V with
statistics per channel (append rule) or per token, head sizes 64, 128 and 256; ``supports`` says
why not for the rest (3 bits, ZipCache channel scales, 16-bit tensors, the KVmix recent window),
which the Triton kernel writes. ``KVCOMPRESS_WRITE`` picks it (``choose``): by default wherever it
covers the format and nvcc exists (``docs/gpu.md`` has the timings against the Triton kernel).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from vllm_kvcompress.formats import KVPageFormat, MinMaxCodec

from . import cuda_jit
from .triton_kernels.layout import page_layout

def supports(fmt: KVPageFormat) -> str | None:
    """None if the CUDA write kernel writes this format, else why not."""
    if fmt.recent is not None:
        return "recent 16-bit window (KVmix RPC)"
    for name, codec in (("K", fmt.k), ("V", fmt.v)):
        if codec is None:
            continue
        if not isinstance(codec, MinMaxCodec):
            return f"{name} kept at 16 bits"
        if codec.bits not in (2, 4, 8):
            return f"{name} at {codec.bits} bits (2, 4 or 8 only)"
        if codec.channel_scaling:
            return f"{name} with ZipCache channel scales"
    if fmt.k.head_size not in (64, 128, 256):
        return f"head size {fmt.k.head_size} (64, 128 or 256 only)"
    if fmt.page_bytes % 8:
        return f"pages of {fmt.page_bytes} bytes (a multiple of 8 only)"
    return None


def choose(mode: str, fmt: KVPageFormat) -> str | None:
    """Under ``KVCOMPRESS_WRITE=mode``: None if the cache write goes to the CUDA kernel, else why it
    goes to the Triton one. ``cuda`` where the CUDA kernel cannot be used is refused."""
    return cuda_jit.choose("KVCOMPRESS_WRITE", mode, "write", lambda: supports(fmt))


@functools.cache
def _library() -> ctypes.CDLL:
    lib = cuda_jit.load("kvcompress_write", "write_kernel.cu", "KVCOMPRESS_WRITE")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    tensor = [p, i64, i32, i32, i32, i32, i32]
    lib.kvc_write.argtypes = [i32, *tensor, *tensor, p, p, i32, i32, i32, i64, i32, i32, i32, p]
    lib.kvc_write.restype = i32
    return lib


def build() -> None:
    """Build (or load the cached build of) the kernel: at startup, not in the middle of serving."""
    _library()


_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@functools.cache
def _launches(fmt: KVPageFormat) -> tuple[tuple, ...]:
    """The format's launches, each (tensors, first source, its layout, second source, its layout,
    bits): source 0 is the key, 1 the value; a layout is (token group, 0 where statistics are per
    channel; codes, row bytes, scale, zero). K and V of one width go in one launch."""
    lay = page_layout(fmt)
    k = (0, (lay.k.token_group, lay.k.codes, lay.k.row_bytes, lay.k.scale, lay.k.zero))
    if fmt.v is None:  # K-only pages
        return ((1, *k, *k, lay.k.bits),)
    v = (1, (lay.v.token_group, lay.v.codes, lay.v.row_bytes, lay.v.scale, lay.v.zero))
    if lay.k.bits == lay.v.bits:
        return ((2, *k, *v, lay.k.bits),)
    return ((1, *k, *k, lay.k.bits), (1, *v, *v, lay.v.bits))


def _source(src: torch.Tensor) -> tuple[int, int]:
    if src.stride(2) != 1 or src.stride(1) != src.shape[2]:
        raise ValueError(f"CUDA write: sources [N, H, D] with contiguous heads and channels, got strides {src.stride()}")
    return src.data_ptr(), src.stride(0)


def write_tokens(cache: torch.Tensor, fmt: KVPageFormat, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Same contract as ``paged_torch.write_tokens``, for formats where ``supports`` is None."""
    from .triton_kernels.launch import stream_handle  # imports Triton: only where a kernel is launched
    n = slot_mapping.shape[0]
    if n == 0:
        return
    slots = slot_mapping.long()
    sources = (key, value)
    tail = (slots.data_ptr(), cache.data_ptr(), n, fmt.k.num_heads, fmt.k.head_size, fmt.page_bytes, fmt.block_size)
    stream = stream_handle(cache.device)
    for count, a, a_layout, b, b_layout, bits in _launches(fmt):
        err = _library().kvc_write(count, *_source(sources[a]), *a_layout, *_source(sources[b]), *b_layout, *tail,
                                   bits, _DTYPES[key.dtype], stream)
        if err:
            raise RuntimeError(f"CUDA write kernel launch failed: cudaError {err}")
