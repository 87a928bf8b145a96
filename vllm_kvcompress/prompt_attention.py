"""Prompt chunks that start their request's context, through vLLM's FlashAttention prefill.

Such a chunk (most prompts arrive in one) attends causally to its own tokens only, all written by
this step. Their K and V as the pages store them are read back into the model's dtype
(``triton_kernels.read_back``) and FlashAttention's varlen prefill runs over them: the attention
the decode kernel's rows of prompt tokens give (``token_rows``: a row a token over the same pages),
in a third of their GPU time or less (H100: docs/benchmarks.md, "prompts with no history"). What a
prompt attends to is unchanged, its tokens as stored; the only difference is arithmetic, the stored
values rounded to the model's dtype (what a 16-bit cache would hold of them) before the products.
Chunks with history (chunked prefill, prefix-cache hits) stay with the decode kernel's rows.

``KVCOMPRESS_PROMPTS`` picks the path: ``triton`` (the default: the decode kernel's rows for every
prompt token) or ``flash`` (this module; refused at startup where FlashAttention cannot be used).
The rows are the default because they measured faster end to end: on the H100's ShareGPT run
(Llama-2-7B shape, 4/4) ``flash`` gave 14,490 and 13,991 tokens/s against 15,105 and 15,037 for the
rows, its mixed steps slower although its kernels take less GPU time (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .formats import KVPageFormat

VARIABLE = "KVCOMPRESS_PROMPTS"
MODES = ("triton", "flash")
DEFAULT = "triton"


@dataclass
class FirstChunks:
    """A step's prompt chunks, for a FlashAttention launch over their tokens (after the decodes')."""
    cu_seqlens: torch.Tensor  # [R + 1] int32 on the device: the chunks' token offsets, from 0
    max_len: int              # tokens of the longest chunk


def choose(mode: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether, under ``KVCOMPRESS_PROMPTS=mode``, chunks with no history go to FlashAttention.
    A value that names no path, or ``flash`` where FlashAttention cannot be used, is refused."""
    if mode not in MODES:
        raise ValueError(f"{VARIABLE}={mode!r}: allowed are 'triton' (the default: the decode kernel's rows) and "
                         "'flash' (FlashAttention over a first chunk's stored K and V)")
    if mode == "triton":
        return False
    why = _why_not_flash(dtype, device)
    if why is not None:
        raise ValueError(f"{VARIABLE}=flash: FlashAttention cannot be used: {why}; allowed: 'triton'")
    return True


def _why_not_flash(dtype: torch.dtype, device: torch.device) -> str | None:
    if device.type != "cuda" or torch.version.hip is not None:
        return f"the cache is on {device.type}, not an NVIDIA GPU"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"model dtype {dtype} (FlashAttention takes float16 and bfloat16)"
    from vllm.v1.attention.backends.fa_utils import is_flash_attn_varlen_func_available
    if not is_flash_attn_varlen_func_available():
        return "this vLLM build has no FlashAttention"
    return None


@functools.cache
def _flash_attention(head_size: int):
    """vLLM's varlen FlashAttention and the version it picks on this GPU for ``head_size``."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version
    return flash_attn_varlen_func, get_flash_attn_version(head_size=head_size)


def attend_first_chunks(query: torch.Tensor, cache: torch.Tensor, fmt: KVPageFormat, slots: torch.Tensor,
                        chunks: FirstChunks, scale: float, out: torch.Tensor) -> None:
    """Causal attention of each chunk's tokens ``query`` [T, Hq, D] over the chunk's own tokens as
    ``cache`` stores them at ``slots`` [T], into ``out`` [T, Hq, D]. Right only for chunks with no
    history; the caller overwrites the others' rows."""
    from .triton_kernels.read_back import stored_kv

    key, value = stored_kv(cache, fmt, slots)
    flash, version = _flash_attention(fmt.k.head_size)
    flash(q=query, k=key, v=value, out=out, cu_seqlens_q=chunks.cu_seqlens, cu_seqlens_k=chunks.cu_seqlens,
          max_seqlen_q=chunks.max_len, max_seqlen_k=chunks.max_len, softmax_scale=scale, causal=True,
          **({} if version is None else {"fa_version": version}))
