"""ZipCache's decode rows over split-row pages (``formats.salient_rows``) by a CUDA kernel
(``salient_rows_decode`` in ``csrc/decode_kernel.cu``): one query head a KV head (MHA), head size 128,
pages of 128 tokens. ``cuda_salient_decode``'s contract for the slot-map pages: each row over its
history and its own new token, in one kernel (and a merge of its splits), leaving the log-sum-exp for
the decode write. Each page is read as quant-k4v4's and quant-k2v2's kernels read a slice (its 4-bit
half by one warp, its 2-bit half by the other), with no joining of planes.

Not served yet: nothing writes split-row pages in serving (``docs/log/2026-12-01.md``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from vllm_kvcompress.formats.salient_rows import SalientRowsFormat

from . import cuda_jit
from .cuda_salient_decode import ROW_FIELDS, launch_rows, plan_rows
from .launch_plans import LaunchPlans

# the split-row page's regions, in the order both its CUDA kernels' arguments take them (the write's too)
REGIONS = ("k_scale", "k_zero", "k4", "v4", "v4_scale", "v4_zero", "k2", "v2", "v2_scale", "v2_zero", "place_of")


class _SalientRowsDecodeArgs(ctypes.Structure):
    """``csrc/decode_kernel.cu``'s SalientRowsDecodeArgs, field for field."""
    _fields_ = ROW_FIELDS + [(name, ctypes.c_int) for name in (*REGIONS, "block_size", "bf16")] \
        + [("stream", ctypes.c_void_p)]


_kernel = cuda_jit.Kernel("kvcompress_decode", "kvc_salient_rows_decode", _SalientRowsDecodeArgs,
                           "KVCOMPRESS_DECODE", "CUDA ZipCache split-row decode kernel")
_plans = LaunchPlans()  # by step (``cuda_decode.step_key``)


_plan = functools.partial(plan_rows, _SalientRowsDecodeArgs, REGIONS)


def decode_rows(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                fmt: SalientRowsFormat, block_table: torch.Tensor, history: torch.Tensor, scale: float,
                longest: int, out: torch.Tensor, row_order: torch.Tensor | None = None,
                num_splits: int | None = None) -> torch.Tensor:
    """``cuda_salient_decode.decode_rows``'s contract over split-row pages; returns each row's natural
    log-sum-exp [H, N]."""
    return launch_rows(_kernel, _plans, _plan, q, key, value, pages, fmt, block_table, history, scale, longest, out,
                       row_order, num_splits)
