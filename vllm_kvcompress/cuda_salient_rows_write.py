"""ZipCache's decode write over split-row pages (``formats.salient_rows``) as a CUDA kernel
(``csrc/salient_rows_write_kernel.cu``): ``cuda_salient_write``'s contract, whose tokens the pages
read as (``SalientRowsFormat.decode``) are those ``salient_torch.write_decoded`` writes into the
slot-map page. Head sizes 64, 128 and 256, pages of 64 or 128 tokens.

Not served yet: the registry gives no layer split-row pages (``docs/log/2026-12-01.md``).
"""

from __future__ import annotations

import ctypes

import torch

from vllm_kvcompress.config import SalientSpec
from vllm_kvcompress.formats.salient_rows import SalientRowsFormat
from vllm_kvcompress.salient_torch import NO_WINDOW, quota_table

from . import cuda_jit
from .cuda_salient_write import _DTYPES, _POINTERS, _STRIDES, launch_write
from .launch_plans import LaunchPlans

_REGIONS = ("k_scale", "k_zero", "k4", "v4", "v4_scale", "v4_zero", "k2", "v2", "v2_scale", "v2_zero", "place_of")


class _SalientRowsWriteArgs(ctypes.Structure):
    """``csrc/salient_rows_write_kernel.cu``'s SalientRowsWriteArgs, field for field."""
    _fields_ = ([(name, ctypes.c_void_p) for name in _POINTERS] + [(name, ctypes.c_int64) for name in _STRIDES]
                + [(name, ctypes.c_int) for name in ("num_rows", "num_heads", "head_size", "block_size", *_REGIONS,
                                                     "interval", "window")]
                + [("scale", ctypes.c_float), ("dtype", ctypes.c_int), ("group", ctypes.c_int),
                   ("stream", ctypes.c_void_p)])


_kernel = cuda_jit.Kernel("kvcompress_salient_rows_write", "kvc_salient_rows_write", _SalientRowsWriteArgs,
                           "KVCOMPRESS_WRITE", "CUDA ZipCache split-row write kernel")
_plans = LaunchPlans()


def _plan(fmt: SalientRowsFormat, spec: SalientSpec, query: torch.Tensor, block_table: torch.Tensor,
          seq_lens: torch.Tensor, scale: float, window: int | None, stream: int) -> _SalientRowsWriteArgs:
    """The launch's arguments but for the pointers each layer sets (query, key, value, lse, cache)."""
    at = fmt.regions.start
    return _SalientRowsWriteArgs(
        block_table=block_table.data_ptr(), seq_lens=seq_lens.data_ptr(),
        quotas=quota_table(fmt.slot_map, query.device).data_ptr(),
        table_stride=block_table.stride(0), page_bytes=fmt.page_bytes, num_rows=query.shape[0],
        num_heads=fmt.k.num_heads, head_size=fmt.k.head_size, block_size=fmt.block_size,
        **{name: at(name) for name in _REGIONS}, interval=spec.recompress_interval, window=window or NO_WINDOW,
        scale=scale, dtype=_DTYPES[query.dtype], group=query.shape[1] // fmt.k.num_heads, stream=stream)


def write_decoded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                  fmt: SalientRowsFormat, spec: SalientSpec, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  lse: torch.Tensor, scale: float, window: int | None = None) -> None:
    """``cuda_salient_write.write_decoded``'s contract over split-row pages."""
    launch_write(_kernel, _plans, _plan, query, key, value, cache, fmt, spec, block_table, seq_lens, lse, scale,
                 window)
