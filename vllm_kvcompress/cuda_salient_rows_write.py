"""ZipCache's decode write over split-row pages (``formats.salient_rows``) as a CUDA kernel
(``csrc/salient_rows_write_kernel.cu``): ``cuda_salient_write``'s contract, whose tokens the pages
read as (``SalientRowsFormat.decode``) are those ``salient_torch.write_decoded`` writes into the
slot-map page. Head sizes 64, 128 and 256, pages of 64 or 128 tokens.

Not served yet: the registry gives no layer split-row pages (``docs/log/2026-12-01.md``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from vllm_kvcompress.config import SalientSpec
from vllm_kvcompress.formats.salient_rows import SalientRowsFormat

from . import cuda_jit
from .cuda_salient_rows_decode import REGIONS
from .cuda_salient_write import _POINTERS, _STRIDES, launch_write, plan_write
from .launch_plans import LaunchPlans


class _SalientRowsWriteArgs(ctypes.Structure):
    """``csrc/salient_rows_write_kernel.cu``'s SalientRowsWriteArgs, field for field."""
    _fields_ = ([(name, ctypes.c_void_p) for name in _POINTERS] + [(name, ctypes.c_int64) for name in _STRIDES]
                + [(name, ctypes.c_int) for name in ("num_rows", "num_heads", "head_size", "block_size", *REGIONS,
                                                     "interval", "window")]
                + [("scale", ctypes.c_float), ("dtype", ctypes.c_int), ("group", ctypes.c_int),
                   ("stream", ctypes.c_void_p)])


_kernel = cuda_jit.Kernel("kvcompress_salient_rows_write", "kvc_salient_rows_write", _SalientRowsWriteArgs,
                           "KVCOMPRESS_WRITE", "CUDA ZipCache split-row write kernel")
_plans = LaunchPlans()


_plan = functools.partial(plan_write, _SalientRowsWriteArgs, REGIONS)


def write_decoded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                  fmt: SalientRowsFormat, spec: SalientSpec, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  lse: torch.Tensor, scale: float, window: int | None = None) -> None:
    """``cuda_salient_write.write_decoded``'s contract over split-row pages."""
    launch_write(_kernel, _plans, _plan, query, key, value, cache, fmt, spec, block_table, seq_lens, lse, scale,
                 window)
