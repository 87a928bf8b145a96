"""ZipCache's decode rows with the history read by a CUDA kernel (``csrc/salient_decode_kernel.cu``): one
query head a KV head (MHA), head size 128, pages of 64 or 128 tokens; the kernel registry
(``kernels.registry``) says which layers it serves. Same contract as
``triton_kernels.salient_decode.decode_rows``: each row over its history in the pages and its own new
token, in one kernel (and a merge of its splits), leaving the log-sum-exp for the decode write.
Prebuilt or built just in time with nvcc (``cuda_jit``) and called through ctypes.

Why a CUDA kernel: it joins a token's two planes into 4-bit codes and reads them in the tensor-core
products of quant-k4v4's CUDA decode (16 tokens or channels of codes by the query or the
probabilities), where the Triton kernel pads its products to 16 query rows of which one is real
(``docs/formats.md``).
"""

from __future__ import annotations

import ctypes

import torch

from vllm_kvcompress.formats.salient import SalientTokensFormat

from . import cuda_jit
from .cuda_decode import set_layer_pointers, step_fields, step_key
from .launch_plans import LaunchPlans

# the slot-map page's regions, in the order both its CUDA kernels' arguments take them (the write's too)
REGIONS = ("k_scale", "k_zero", "v_scale", "v_zero", "k_high", "v_high", "k_low", "v_low", "slot_of")


# The fields both ZipCache decodes' argument structs open with (this one's, ``cuda_salient_rows_decode``'s),
# before the page's regions
ROW_FIELDS = [(name, ctypes.c_void_p) for name in ("query", "cache", "block_table", "seq_lens", "row_order", "key",
                                                   "value", "out", "part", "lse")] \
    + [("q_scale", ctypes.c_float)] \
    + [(name, ctypes.c_int64) for name in ("q_stride", "k_stride", "v_stride", "out_stride", "bt_stride", "page_bytes",
                                           "lse_stride")] \
    + [(name, ctypes.c_int) for name in ("blocks_per_split", "num_splits", "table_blocks", "num_rows", "num_heads")]


class _SalientDecodeArgs(ctypes.Structure):
    """``csrc/salient_decode_kernel.cu``'s SalientDecodeArgs, field for field."""
    _fields_ = ROW_FIELDS + [(name, ctypes.c_int) for name in (*REGIONS, "slots", "block_size", "bf16")] \
        + [("stream", ctypes.c_void_p)]


_kernel = cuda_jit.Kernel("kvcompress_salient_decode", "kvc_salient_decode", _SalientDecodeArgs,
                           "KVCOMPRESS_DECODE", "CUDA ZipCache decode kernel")
build = _kernel.build  # at startup, not in the middle of serving


_plans = LaunchPlans()  # by step (``cuda_decode.step_key``): the arguments but the tensors each layer has


def plan_rows(args_type: type[ctypes.Structure], regions: tuple[str, ...], fmt, query: torch.Tensor,
              out: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, row_order: torch.Tensor | None,
              sm_scale: float, max_seq_len: int, num_splits: int | None, stream: int, **fields) -> ctypes.Structure:
    """A ZipCache decode's launch arguments but the tensors each layer has (both pages' kernels): the
    step's (``cuda_decode.step_fields``), the page's ``regions`` and block size, and ``fields``."""
    at = fmt.regions.start
    return args_type(
        **step_fields(fmt, query, out, block_table, seq_lens, row_order, sm_scale, max_seq_len, num_splits, stream),
        **{name: at(name) for name in regions}, block_size=fmt.block_size, **fields)


def _plan(fmt: SalientTokensFormat, *step) -> _SalientDecodeArgs:
    return plan_rows(_SalientDecodeArgs, REGIONS, fmt, *step, slots=fmt.slots)


def decode_rows(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                fmt: SalientTokensFormat, block_table: torch.Tensor, history: torch.Tensor, scale: float,
                longest: int, out: torch.Tensor, row_order: torch.Tensor | None = None,
                num_splits: int | None = None) -> torch.Tensor:
    """``triton_kernels.salient_decode.decode_rows``'s contract: decode rows (``q`` [N, H, D],
    ``key``/``value`` [N, H, D]) over the ``history`` tokens before each new one (at most ``longest``)
    and the new token, into ``out``; returns each row's natural log-sum-exp [H, N]."""
    return launch_rows(_kernel, _plans, _plan, q, key, value, pages, fmt, block_table, history, scale, longest, out,
                       row_order, num_splits)


def launch_rows(kernel: cuda_jit.Kernel, plans: LaunchPlans, plan, q: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, pages: torch.Tensor, fmt, block_table: torch.Tensor, history: torch.Tensor,
                scale: float, longest: int, out: torch.Tensor, row_order: torch.Tensor | None,
                num_splits: int | None) -> torch.Tensor:
    """``decode_rows`` through ``kernel``, whose launch arguments ``plan`` makes once a step (both of
    ZipCache's CUDA decodes: slot-map and split-row pages)."""
    n, hq, d = q.shape
    for name, x in (("key", key), ("value", value)):
        if x.shape != q.shape or x.stride(1) != d or x.stride(2) != 1:
            raise ValueError(f"{kernel.what}: {name} {tuple(x.shape)} with strides {x.stride()}; "
                             f"allowed: {tuple(q.shape)}, heads and channels contiguous within a row")
    lse = torch.empty(hq, n, dtype=torch.float32, device=q.device)
    if n == 0:
        return lse
    query, q_stride, out = cuda_jit.triton_kernels("decode").query_and_output(q, out)
    stream = cuda_jit.triton_kernels("launch").stream_handle(query.device)
    plan_key = step_key(fmt, query, block_table, history, row_order, scale, longest, num_splits, stream)
    args = plans.get(plan_key, lambda: plan(fmt, query, out, block_table, history, row_order, scale, longest,
                                            num_splits, stream))
    set_layer_pointers(args, query, q_stride, pages, out)
    args.key, args.k_stride, args.value, args.v_stride = key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0)
    args.lse, args.lse_stride = lse.data_ptr(), lse.stride(0)
    kernel(args)
    return lse
