"""The cache write as a CUDA kernel (``csrc/write_kernel.cu``), built just in time with
``torch.utils.cpp_extension`` where nvcc exists, and cached by torch (``TORCH_EXTENSIONS_DIR``).

Same contract and bytes as ``paged_torch.write_tokens``. It covers 2-, 4- and 8-bit K and V with
statistics per channel (append rule) or per token; ``supports`` says why not for the rest (3 bits,
ZipCache channel scales, 16-bit tensors, the KVmix recent window), which the Triton kernel writes.
The backend uses it only when asked (``KVCOMPRESS_WRITE=cuda``): on an H200 it is slower than the
Triton kernel (``docs/gpu.md``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from vllm_kvcompress.formats import KVPageFormat, MinMaxCodec

from .triton_kernels.layout import page_layout

SOURCE = Path(__file__).resolve().parent / "csrc" / "write_kernel.cu"


def nvcc_available() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME
    return CUDA_HOME is not None and (Path(CUDA_HOME) / "bin" / "nvcc").exists()


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
    if fmt.k.head_size > 1024:
        return f"head size {fmt.k.head_size} (1024 at most)"
    return None


@functools.cache
def _extension():
    from torch.utils.cpp_extension import load
    return load(name="kvcompress_write", sources=[str(SOURCE)], extra_cuda_cflags=["-O3"], verbose=False)


def require(fmt: KVPageFormat) -> None:
    """Build (or load the cached build of) the extension for ``fmt``, or say why it cannot be used."""
    why = supports(fmt) or (None if nvcc_available() else "no nvcc (set CUDA_HOME to a CUDA toolkit)")
    if why:
        raise ValueError(f"KVCOMPRESS_WRITE=cuda: the CUDA write kernel cannot write this format: {why}; "
                         "allowed: unset or 'triton' (the Triton kernel)")
    _extension()


def write_tokens(cache: torch.Tensor, fmt: KVPageFormat, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Same contract as ``paged_torch.write_tokens``, for formats where ``supports`` is None."""
    ext = _extension()
    lay = page_layout(fmt)
    slots = slot_mapping.long()
    for src, codec, t in ((key, fmt.k, lay.k), (value, fmt.v, lay.v)):
        if t is not None:  # None: K-only pages
            ext.write_tensor(src, slots, cache, fmt.page_bytes, fmt.block_size, t.bits, codec.axis == "channel",
                             t.codes, t.row_bytes, t.scale, t.zero)
