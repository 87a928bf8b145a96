"""ZipCache's decode write as a CUDA kernel (``csrc/salient_write_kernel.cu``), prebuilt or built just
in time with nvcc (``cuda_jit``) and called through ctypes.

Same contract and pages as ``salient_torch.write_decoded`` and the Triton write's decode rows
(``triton_kernels.salient_write.write_decoded``, which serves where the CUDA kernels cannot be had): one warp per
(row, KV head) instead of a Triton program whose block-wide reductions wait on each other. The kernel
registry (``kernels.registry``) gives it the decode rows where it can be had, unless
``KVCOMPRESS_WRITE=triton``, and where a KV head's query heads fit its shared memory.
"""

from __future__ import annotations

import ctypes

import torch

from vllm_kvcompress.config import SalientSpec
from vllm_kvcompress.formats.salient import SalientTokensFormat
from vllm_kvcompress.salient_torch import NO_WINDOW, last_block_random_scores, quota_table

from . import cuda_jit
from .cuda_salient_decode import REGIONS
from .launch_plans import LaunchPlans

_POINTERS = ("query", "key", "value", "lse", "given", "block_table", "seq_lens", "quotas", "cache")
_STRIDES = ("q_row_stride", "q_head_stride", "k_row_stride", "v_row_stride", "lse_row_stride", "lse_head_stride",
            "table_stride", "page_bytes")
_SIZES = ("num_rows", "num_heads", "head_size", "block_size", "slots")


class _SalientWriteArgs(ctypes.Structure):
    """``csrc/salient_write_kernel.cu``'s SalientWriteArgs, field for field."""
    _fields_ = ([(name, ctypes.c_void_p) for name in _POINTERS] + [(name, ctypes.c_int64) for name in _STRIDES]
                + [(name, ctypes.c_int) for name in _SIZES + REGIONS + ("interval", "window")]
                + [("scale", ctypes.c_float), ("dtype", ctypes.c_int), ("stream", ctypes.c_void_p),
                   ("group", ctypes.c_int)])


_kernel = cuda_jit.Kernel("kvcompress_salient_write", "kvc_salient_write", _SalientWriteArgs,
                           "KVCOMPRESS_WRITE", "CUDA ZipCache write kernel")
build = _kernel.build  # at startup, not in the middle of serving


_DTYPES = {torch.float16: 1, torch.bfloat16: 2}


_plans = LaunchPlans()  # by step: rows, block table, lengths, format and what else is the same every layer


def plan_write(args_type: type[ctypes.Structure], regions: tuple[str, ...], fmt, spec: SalientSpec,
               query: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
               window: int | None, stream: int, **fields) -> ctypes.Structure:
    """A ZipCache decode write's launch arguments but for the pointers each layer sets (query, key,
    value, lse, cache), both pages' kernels: the page's ``regions`` and ``fields`` with the rest."""
    at = fmt.regions.start
    return args_type(
        block_table=block_table.data_ptr(), seq_lens=seq_lens.data_ptr(), quotas=quota_table(fmt, query.device).data_ptr(),
        table_stride=block_table.stride(0), page_bytes=fmt.page_bytes, num_rows=query.shape[0],
        num_heads=fmt.k.num_heads, head_size=fmt.k.head_size, block_size=fmt.block_size,
        **{name: at(name) for name in regions}, interval=spec.recompress_interval, window=window or NO_WINDOW,
        scale=scale, dtype=_DTYPES[query.dtype], stream=stream, group=query.shape[1] // fmt.k.num_heads, **fields)


def _plan(fmt: SalientTokensFormat, *step) -> _SalientWriteArgs:
    return plan_write(_SalientWriteArgs, REGIONS, fmt, *step, slots=fmt.slots)


def write_decoded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                  fmt: SalientTokensFormat, spec: SalientSpec, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  lse: torch.Tensor, scale: float, window: int | None = None) -> None:
    """``salient_torch.write_decoded``'s contract: each decode row's new token (``key``/``value`` [N, H,
    D], contiguous channels) into its last block, scored by its ``query`` [N, Hq, D] with ``lse`` [N,
    Hq] float32 (its attention's log-sum-exp over the whole context, or its sliding ``window``)."""
    launch_write(_kernel, _plans, _plan, query, key, value, cache, fmt, spec, block_table, seq_lens, lse, scale,
                 window)


def launch_write(kernel: cuda_jit.Kernel, plans: LaunchPlans, plan, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, cache: torch.Tensor, fmt, spec: SalientSpec, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, lse: torch.Tensor, scale: float, window: int | None) -> None:
    """``write_decoded`` through ``kernel``, whose launch arguments ``plan`` makes once a step (both of
    ZipCache's CUDA decode writes: slot-map and split-row pages)."""
    n = query.shape[0]
    if n == 0:
        return
    if query.dtype not in _DTYPES:
        raise ValueError(f"{kernel.what}: queries in {query.dtype}; allowed: float16, bfloat16")
    if query.shape[1] % fmt.k.num_heads:
        raise ValueError(f"{kernel.what}: {query.shape[1]} query heads for {fmt.k.num_heads} KV heads; "
                         "allowed: a whole number a KV head")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.stride(-1) != 1 or (name != "query" and x.stride(1) != x.shape[2]):
            raise ValueError(f"{kernel.what}: {name} with contiguous heads and channels, got strides {x.stride()}")
    stream = cuda_jit.triton_kernels("launch").stream_handle(cache.device)
    plan_key = (fmt, spec, n, query.shape[1], query.dtype, block_table.data_ptr(), block_table.stride(0),
                seq_lens.data_ptr(), scale, window, stream)
    args = plans.get(plan_key, lambda: plan(fmt, spec, query, block_table, seq_lens, scale, window, stream))
    given = None
    if spec.score == "random":
        given = last_block_random_scores(seq_lens, fmt.block_size, fmt.k.num_heads, spec)
    args.query, args.q_row_stride, args.q_head_stride = query.data_ptr(), query.stride(0), query.stride(1)
    args.key, args.k_row_stride = key.data_ptr(), key.stride(0)
    args.value, args.v_row_stride = value.data_ptr(), value.stride(0)
    args.lse, args.lse_row_stride, args.lse_head_stride = lse.data_ptr(), lse.stride(0), lse.stride(1)
    args.given = None if given is None else given.data_ptr()
    args.cache = cache.data_ptr()
    kernel(args)
