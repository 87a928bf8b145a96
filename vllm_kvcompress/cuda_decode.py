"""Decode attention as a CUDA kernel (``csrc/decode_kernel.cu``) for the formats where the Triton
kernel leaves most speed behind: 4/4- and 2/2-bit pages, head size 128, pages of 64 or 128 tokens, one
query head a KV head (MHA) or groups of 2 or 4 (GQA; 4 at 2 bits); the kernel registry
(``kernels.registry``) says which formats it serves. Groups of 8 were no faster than the Triton
kernel (``docs/benchmarks.md``) and stay with it. Built just in time with nvcc through
``torch.utils.cpp_extension`` (cached by torch under ``TORCH_EXTENSIONS_DIR``) and called through
ctypes, so the build includes no torch headers (a few seconds).

``paged_decode`` takes the Triton kernel's decode rows (one token a request; prompt tokens go to the
Triton kernel's grouped rows). Splits of a long context are merged by a CUDA kernel launched in the
same call.
"""

from __future__ import annotations

import ctypes

import torch

from vllm_kvcompress.formats import KVPageFormat

from . import cuda_jit
from .launch_plans import LaunchPlans
from .formats.layout import page_layout

_LOG2E = 1.4426950408889634
# The split count aims for 4 programs a SM (the Triton kernel's rule asks for 2), and is at most the
# longest context's 256-token pieces rounded up to a power of two, whatever the page size.
# Decode alone in a CUDA graph, rows of up to 1,150 to 2,000 tokens, this gives the fastest count
# measured, or one within noise of it, from 3 to 40 rows: 12 and 16 rows take 2 splits (25.0 and
# 24.5 us a layer against 31.4 and 29.2 with one), 5 rows 4 (16.6 against 20.2 with 2), and splits
# of 128 tokens were slower than splits of 256 at every row count timed (docs/benchmarks.md,
# "split counts for a few rows' decode").
PROGRAMS_PER_SM = 4
_TOKENS_A_SPLIT = 256


class _DecodeArgs(ctypes.Structure):
    """``csrc/decode_kernel.cu``'s DecodeArgs, field for field."""
    _fields_ = [(name, ctypes.c_void_p) for name in ("query", "cache", "block_table", "seq_lens", "row_order", "out",
                                                     "part")] \
        + [("q_scale", ctypes.c_float)] \
        + [(name, ctypes.c_int64) for name in ("q_stride", "out_stride", "bt_stride", "page_bytes")] \
        + [(name, ctypes.c_int) for name in ("blocks_per_split", "num_splits", "table_blocks", "num_rows", "num_heads",
                                             "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero",
                                             "block_size", "bits", "group", "bf16")] \
        + [("stream", ctypes.c_void_p)]


_kernel = cuda_jit.Kernel("kvcompress_decode", "kvc_decode", _DecodeArgs, "KVCOMPRESS_DECODE",
                           "CUDA decode kernel")
build = _kernel.build  # at startup, not in the middle of serving


def choose_num_splits(num_rows: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """The split count of a launch over contexts of up to ``max_seq_len`` tokens."""
    return cuda_jit.triton_kernels("decode").choose_num_splits(num_rows, num_kv_heads, max_seq_len, _TOKENS_A_SPLIT,
                                                               device, PROGRAMS_PER_SM)


def step_key(fmt, query: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
             row_order: torch.Tensor | None, sm_scale: float, max_seq_len: int, num_splits: int | None,
             stream: int) -> tuple:
    """What a step's decode launches share across its layers (a ``LaunchPlans`` key, both CUDA decode
    kernels'): pointers and sizes, no tensors."""
    return (fmt, *query.shape, query.dtype, block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
            None if row_order is None else row_order.data_ptr(), sm_scale, max_seq_len, num_splits, stream)


def step_fields(fmt, query: torch.Tensor, out: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                row_order: torch.Tensor | None, sm_scale: float, max_seq_len: int, num_splits: int | None,
                stream: int) -> dict:
    """The launch arguments both CUDA decode kernels (this one, ``cuda_salient_decode``'s) take the same
    way, worked out once a step: rows, lengths, order and block table, the split count and its
    partials, the query scale, the page size, the stream. Each layer's call sets its own pointers
    (``set_layer_pointers``)."""
    if num_splits is None:
        num_splits = choose_num_splits(query.shape[0], fmt.k.num_heads, max_seq_len, query.device)
    run = cuda_jit.triton_kernels("decode").split_launch(query, out, fmt, max_seq_len, num_splits, PROGRAMS_PER_SM)
    return dict(
        block_table=block_table.data_ptr(), seq_lens=seq_lens.data_ptr(),
        row_order=None if row_order is None else row_order.data_ptr(),
        part=None if run.num_splits == 1 else run.part.data_ptr(), q_scale=sm_scale * _LOG2E,
        bt_stride=block_table.stride(0), page_bytes=fmt.page_bytes, blocks_per_split=run.blocks_per_split,
        num_splits=run.num_splits, table_blocks=run.max_blocks, num_rows=query.shape[0], num_heads=fmt.k.num_heads,
        bf16=int(query.dtype == torch.bfloat16), stream=stream)


def set_layer_pointers(args: ctypes.Structure, query: torch.Tensor, q_stride: int, cache: torch.Tensor,
                       out: torch.Tensor) -> None:
    """A layer's own query, cache and output into a planned launch (with one split its partials are
    its output)."""
    args.query, args.q_stride, args.cache = query.data_ptr(), q_stride, cache.data_ptr()
    args.out, args.out_stride = out.data_ptr(), out.stride(0)
    if args.num_splits == 1:
        args.part = args.out


_plans = LaunchPlans()  # by step (``step_key``): the arguments but query, cache, output


def _plan(fmt: KVPageFormat, query: torch.Tensor, out: torch.Tensor, block_table: torch.Tensor,
          seq_lens: torch.Tensor, row_order: torch.Tensor | None, sm_scale: float, max_seq_len: int,
          num_splits: int | None, stream: int) -> _DecodeArgs:
    """The launch's arguments but for its query, cache and output (as ``query_and_output`` gives
    them), which each call sets."""
    lay = page_layout(fmt)
    return _DecodeArgs(
        **step_fields(fmt, query, out, block_table, seq_lens, row_order, sm_scale, max_seq_len, num_splits, stream),
        k_codes=lay.k.codes, k_scale=lay.k.scale, k_zero=lay.k.zero, v_codes=lay.v.codes, v_scale=lay.v.scale,
        v_zero=lay.v.zero, block_size=fmt.block_size, bits=lay.k.bits, group=query.shape[1] // fmt.k.num_heads)


def paged_decode(query: torch.Tensor, cache: torch.Tensor, fmt: KVPageFormat, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, sm_scale: float, max_seq_len: int, num_splits: int | None = None,
                 out: torch.Tensor | None = None, row_order: torch.Tensor | None = None) -> torch.Tensor:
    """``triton_kernels.decode.paged_decode``'s contract for decode rows, for the formats the registry
    gives this kernel."""
    query, q_stride, out = cuda_jit.triton_kernels("decode").query_and_output(query, out)
    if query.shape[0] == 0:
        return out
    stream = cuda_jit.triton_kernels("launch").stream_handle(query.device)
    key = step_key(fmt, query, block_table, seq_lens, row_order, sm_scale, max_seq_len, num_splits, stream)
    args = _plans.get(key, lambda: _plan(fmt, query, out, block_table, seq_lens, row_order, sm_scale, max_seq_len,
                                         num_splits, stream))
    set_layer_pointers(args, query, q_stride, cache, out)
    _kernel(args)
    return out
