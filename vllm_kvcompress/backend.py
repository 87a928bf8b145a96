"""The vLLM attention backend that keeps K/V in compressed pages.

Each layer's cache is one opaque page per block (``num_head_slots=1``, a page
of ``block_size`` equal slots), laid out by the layer's ``KVPageFormat``. The
backend only moves pages and calls what the kernel registry planned for the
layer (``kernels.registry.plan``): a kernel, or the torch reference (``paged_torch``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from . import paged_torch, policy, salient_torch
from .config import SalientSpec
from .engine_config import ModelKVShape, active_config, full_cuda_graphs, layer_page_format, platform_device
from .formats import KVPageFormat
from .formats.merged import MergedPairFormat
from .formats.salient import SalientTokensFormat
from .kernels import registry
from .slim_loader import ATTRIBUTE
from .token_rows import TokenRows, token_rows

BACKEND_NAME = "KVCOMPRESS"
# K's per-channel scales and zeros are per page: 0.25 bit a value at 128 tokens (2 bits at 16),
# and the decode kernel runs fastest on 128-token pages.
PAGE_TOKENS = 128
logger = init_logger("vllm.kvcompress")


class KVCompressBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["KVCompressImpl"]:
        return KVCompressImpl

    @staticmethod
    def get_builder_cls() -> type["KVCompressMetadataBuilder"]:
        return KVCompressMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """vLLM sets the block size from this once the backend is chosen, unless --block-size is given."""
        return PAGE_TOKENS

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


def compressed_spec(spec: AttentionSpec, fmt: KVPageFormat) -> AttentionSpec:
    """The layer's spec with its page replaced by ``fmt``'s (one head slot, ``slot_bytes`` a token)."""
    return replace(spec, num_head_slots=1, state_content_bytes=fmt.slot_bytes)


@dataclass
class KVCompressMetadata:
    num_actual_tokens: int
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int  # the first num_decodes requests have one query token each
    decode_block_table: torch.Tensor  # block_table[:num_decodes]
    decode_seq_lens: torch.Tensor     # [num_decodes] on the device
    decode_max_seq_len: int           # at least the longest decode's context (0: no decodes)
    decode_row_order: torch.Tensor | None  # on CUDA, the decodes longest first (the kernel's row_order)
    token_rows: TokenRows | None  # on CUDA, the prefill chunks (after the decodes): rows over their history
    _decode_first_keys: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _chunk_writes: dict[tuple, salient_torch.ChunkWrites | None] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def decode_history_lens(self) -> torch.Tensor:
        """Each decode's context before its new token: what a merged pair's pages hold during the step
        (they take the step's tokens after both layers' attention). Made once a step."""
        return (self.decode_seq_lens - 1).clamp_(min=0)  # a full CUDA graph's padding rows: context 0

    def chunk_writes(self, fmt: SalientTokensFormat, spec: SalientSpec) -> salient_torch.ChunkWrites | None:
        """Where ZipCache's layers write the step's prompt chunks, and their probes
        (``salient_torch.plan_chunk_writes``). Made once a step."""
        key = (fmt, spec)
        if key not in self._chunk_writes:
            nd = self.num_decodes
            start = self.query_start_loc[nd]
            self._chunk_writes[key] = salient_torch.plan_chunk_writes(
                fmt, spec, [x - start for x in self.query_start_loc[nd:]], self.seq_lens[nd:], self.block_table[nd:])
        return self._chunk_writes[key]

    def decode_first_keys(self, window: int) -> torch.Tensor:
        """The first key each decode sees in a layer of this sliding window: its context less the
        window (may be below 0). Made once a step for each window."""
        if window not in self._decode_first_keys:
            self._decode_first_keys[window] = self.decode_seq_lens - window
        return self._decode_first_keys[window]


class KVCompressMetadataBuilder(AttentionMetadataBuilder[KVCompressMetadata]):
    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        """Full CUDA graphs of decode-only batches where a decode step runs without the host
        (``engine_config.full_cuda_graphs``); otherwise vLLM's piecewise graphs around eager attention."""
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        if isinstance(kv_cache_spec, SlidingWindowSpec):
            return AttentionCGSupport.NEVER
        if full_cuda_graphs(active_config(vllm_config), ModelKVShape.of(vllm_config), platform_device()):
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)  # decodes first, so they go to the decode kernel as one batch
        self._rows_per_group = 1  # prompt tokens one decode-kernel program takes together
        self._row_order = None  # where each step's decode order goes: CUDA graphs read it there
        if self.device.type == "cuda":
            from .triton_kernels.decode import rows_per_program
            mc, pc = vllm_config.model_config, vllm_config.parallel_config
            self._rows_per_group = rows_per_program(mc.get_num_attention_heads(pc) // mc.get_num_kv_heads(pc))
            self._row_order = torch.zeros(vllm_config.scheduler_config.max_num_seqs, dtype=torch.int32,
                                          device=device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVCompressMetadata:
        cam = common_attn_metadata
        n = cam.num_reqs
        seq_lens_host = cam.seq_lens_cpu_upper_bound
        if seq_lens_host is None:
            seq_lens_host = cam.seq_lens.cpu()
        seq_lens_host = seq_lens_host[:n]
        seq_lens = seq_lens_host.tolist()
        query_start_loc = cam.query_start_loc_cpu[: n + 1].tolist()
        num_decodes = 0
        while num_decodes < n and query_start_loc[num_decodes + 1] - query_start_loc[num_decodes] == 1:
            num_decodes += 1
        # A full CUDA graph's batch is padded after its decodes with requests of no tokens: not
        # prompts, but rows of the graph's decode launch (context 0, so taken last in the order).
        has_prompts = query_start_loc[num_decodes] < query_start_loc[n]
        rows, order = None, None
        if self._row_order is not None and num_decodes:
            from .triton_kernels.decode import longest_first
            ordered = num_decodes if has_prompts else n
            # from the host's context lengths (upper bounds are as good for an order): a sort on the
            # device costs the host more than the step's other metadata
            order = longest_first(seq_lens_host[:ordered], out=self._row_order[:ordered])[:num_decodes]
        if self.device.type == "cuda" and has_prompts:  # the prefill chunks' tokens, after the decodes
            d, first = num_decodes, query_start_loc[num_decodes]
            # the host's context lengths are exact for prompt chunks (vLLM: upper bounds only for decodes)
            histories = [seq_lens[i] - (query_start_loc[i + 1] - query_start_loc[i]) for i in range(d, n)]
            rows = token_rows([x - first for x in query_start_loc[d: n + 1]], histories, cam.block_table_tensor[d:n],
                              self._rows_per_group)
        return KVCompressMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=cam.block_table_tensor[:n],
            slot_mapping=cam.slot_mapping,
            num_decodes=num_decodes,
            decode_block_table=cam.block_table_tensor[:num_decodes],
            decode_seq_lens=cam.seq_lens[:num_decodes],
            decode_max_seq_len=max(seq_lens[:num_decodes], default=0),
            decode_row_order=order,
            token_rows=rows,
        )


class KVCompressImpl(AttentionImpl[KVCompressMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 **unsupported) -> None:
        for name, value in (("alibi_slopes", alibi_slopes), ("logits_soft_cap", logits_soft_cap)):
            if value:
                raise ValueError(f"kv-compression: attention with {name} is not supported")
        if any(v is not None for v in unsupported.values()):
            raise ValueError(f"kv-compression: attention options {sorted(unsupported)} are not supported")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window  # keys p - sliding_window < j <= p, as in vLLM's other backends
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        vllm_config = get_current_vllm_config()
        self._config = active_config(vllm_config)
        self._dtype = vllm_config.model_config.dtype
        self._max_model_len = vllm_config.model_config.max_model_len
        self._num_layers = vllm_config.model_config.get_total_num_hidden_layers()
        # in a merged pair (MiniCache): 0 the first layer, 1 the second (which shares the first one's cache)
        self._pair_layer = int(kv_sharing_target_layer_name is not None)
        self._format: KVPageFormat | None = None
        self._decode_kernel = None  # decode rows' kernel (None: the torch path takes the decodes)
        self._prompt_kernel = None  # prompt tokens' kernel, as decode rows (None: the torch path)
        self._write = paged_torch.write_tokens
        # compile the kernels' variants a step may launch, once, outside CUDA-graph capture
        self._warm_ups: list = []
        self._kv_cache: torch.Tensor | None = None  # the tensor self._cache_pages views
        self._cache_pages: torch.Tensor | None = None

    def _plan_layer(self, fmt: KVPageFormat, layer, device: torch.device) -> registry.LayerPlan:
        """Ask the registry which implementation serves each operation here; build and load those."""
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        slim = getattr(layer, ATTRIBUTE, None) if fmt.v is None else None
        ctx = registry.LayerContext(registry.Device.of(device.type, capability), self._dtype, self.num_heads,
                                    self.sliding_window, None if slim is None else slim.rotary)
        plan = registry.plan(fmt, ctx, policy.current())
        for choice in (plan.decode, plan.prompt, plan.write):
            prepare = choice.implementation.load("prepare")
            if prepare is not None:  # a CUDA kernel's build: at startup, not in the middle of serving
                prepare()
        self._decode_kernel = plan.decode.implementation.load()
        self._prompt_kernel = plan.prompt.implementation.load()
        self._write = plan.write.implementation.load()
        if isinstance(fmt, MergedPairFormat) and plan.write.name == "torch":
            self._write = paged_torch.write_pair_tokens  # a pair's write takes both layers' tokens
        decode_warm_ups = {c.implementation.load("warm_up") for c in (plan.decode, plan.prompt)} - {None}
        self._warm_ups = [lambda pages, dtype, w=w: w(pages, fmt, self.num_heads, dtype, **self._window_args())
                          for w in decode_warm_ups]
        write_warm_up = plan.write.implementation.load("warm_up")
        if write_warm_up is not None:
            self._warm_ups.append(lambda pages, dtype: write_warm_up(pages, fmt, dtype))
        return plan

    def _page_format(self, layer, kv_cache: torch.Tensor) -> KVPageFormat:
        if self._format is None:
            index = extract_layer_index(layer.layer_name)
            self._format = layer_page_format(self._config, index, self._num_layers, self._dtype, kv_cache.shape[2],
                                             self.num_kv_heads, self.head_size)
            plan = self._plan_layer(self._format, layer, kv_cache.device)
            logger.info_once("kv-compression: each layer's cache holds %d pages of %d tokens (%s tokens)",
                             kv_cache.shape[0], kv_cache.shape[2], f"{kv_cache.shape[0] * kv_cache.shape[2]:,}")
            logger.debug("kv-compression: layer %d: %s", index, plan.describe())
        return self._format

    def _window_args(self, first_keys_of=None) -> dict:
        """A sliding-window layer's kernel arguments (none for full attention): the window and, where
        ``first_keys_of`` is given (the step's first keys by window), each row's first key."""
        if self.sliding_window is None:
            return {}
        if first_keys_of is None:
            return {"window": self.sliding_window}
        return {"window": self.sliding_window, "first_keys": first_keys_of(self.sliding_window)}

    def _longest_decode(self, md: KVCompressMetadata) -> int:
        """The context a step's decode launch is sized for: under CUDA-graph capture the longest the
        model allows (a graph keeps the launch for every later batch of its size), else the step's."""
        return self._max_model_len if torch.cuda.is_current_stream_capturing() else md.decode_max_seq_len

    def _warm_up(self, pages: torch.Tensor, dtype: torch.dtype) -> None:
        if self._warm_ups and not torch.cuda.is_current_stream_capturing():
            for warm_up in self._warm_ups:
                warm_up(pages, dtype)
            self._warm_ups = []

    def _pages(self, kv_cache: torch.Tensor, fmt: KVPageFormat) -> torch.Tensor:
        """``[num_blocks, 1, block_size, slot elems]`` cache view -> ``[num_blocks, page_bytes]`` uint8,
        made once for the layer's cache tensor (views cost the host microseconds in every layer)."""
        if kv_cache is not self._kv_cache:
            self._kv_cache = kv_cache
            self._cache_pages = kv_cache.view(torch.uint8).reshape(kv_cache.shape[0], fmt.page_bytes)
        return self._cache_pages

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        if kv_cache.numel() == 0:
            return
        fmt = self._page_format(layer, kv_cache)
        if isinstance(fmt, SalientTokensFormat):  # written after attention, which picks the salient tokens
            return
        n = slot_mapping.shape[0]
        if isinstance(fmt, MergedPairFormat):  # the pair's second layer writes both layers' tokens
            _pair_tokens[layer.layer_name] = (key[:n].view(n, self.num_kv_heads, -1).clone(),
                                              value[:n].view(n, self.num_kv_heads, -1).clone(), slot_mapping[:n])
            return
        pages = self._pages(kv_cache, fmt)
        self._warm_up(pages, key.dtype)
        self._write(pages, fmt, key[:n].view(n, self.num_kv_heads, -1), value[:n].view(n, self.num_kv_heads, -1),
                    slot_mapping)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: KVCompressMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kv-compression: fused output quantization is not supported")
        if attn_metadata is None:  # profiling run
            return output
        fmt = self._page_format(layer, kv_cache)
        md = attn_metadata
        t = md.num_actual_tokens
        q = query[:t].view(t, self.num_heads, self.head_size)
        out = output[:t].view(t, self.num_heads, self.head_size)
        pages = self._pages(kv_cache, fmt)
        if isinstance(fmt, MergedPairFormat):
            self._forward_merged(layer, q, key, value, pages, fmt, md, out)
            return output
        if isinstance(fmt, SalientTokensFormat):
            self._forward_salient(q, key, value, pages, fmt, md, out)
            return output
        self._warm_up(pages, q.dtype)
        slim = getattr(layer, ATTRIBUTE) if fmt.v is None else None  # attached at model load
        nd = md.num_decodes if self._decode_kernel is not None else 0
        if nd:
            decode_args = (q[:nd], pages, fmt, md.decode_block_table, md.decode_seq_lens, self.scale,
                           self._longest_decode(md))
            if slim is not None:
                self._decode_kernel(*decode_args, slim, out=out[:nd])
            else:
                self._decode_kernel(*decode_args, out=out[:nd], row_order=md.decode_row_order,
                                    **self._window_args(md.decode_first_keys))
        start = md.query_start_loc[nd]
        if start < t:  # prompt tokens (a full CUDA graph's padding has none)
            rows = md.token_rows
            k_new = key[start:t].view(t - start, self.num_kv_heads, self.head_size)
            v_new = value[start:t].view(t - start, self.num_kv_heads, self.head_size)
            if self._prompt_kernel is not None and rows is not None:
                if slim is not None:
                    self._prompt_kernel(q[start:], k_new, v_new, pages, fmt, rows, md.query_start_loc[nd:],
                                        md.seq_lens[nd:], md.block_table[nd:], self.scale, slim, out[start:])
                else:
                    self._prompt_kernel(q[start:], k_new, v_new, pages, fmt, rows, self.scale, out=out[start:],
                                        **self._window_args())
                return output
            rest = ([x - start for x in md.query_start_loc[nd:]], md.seq_lens[nd:], md.block_table[nd:], self.scale)
            if slim is not None:
                out[start:] = paged_torch.attend_k_only(q[start:], pages, fmt, *rest, slim, k_new, v_new)
            else:
                out[start:] = paged_torch.attend(q[start:], pages, fmt, *rest, self.sliding_window,
                                                 key=k_new, value=v_new)
        return output

    def _forward_salient(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                         fmt: SalientTokensFormat, md: KVCompressMetadata, out: torch.Tensor) -> None:
        """ZipCache: attention, then the step's tokens written with each touched block's choice of
        4-bit tokens; decodes, and prompt chunks, through the planned kernels where there are some."""
        t = q.shape[0]
        k, v = (x[:t].view(t, self.num_kv_heads, self.head_size) for x in (key, value))
        spec = self._config.salient
        self._warm_up(pages, q.dtype)
        nd = md.num_decodes if self._decode_kernel is not None else 0
        if nd:
            decodes = q[:nd], k[:nd], v[:nd]  # views cost the host a microsecond or more each: made once
            lse = self._decode_kernel(*decodes, pages, fmt, md.decode_block_table, md.decode_history_lens, self.scale,
                                      self._longest_decode(md), out[:nd], row_order=md.decode_row_order,
                                      **self._window_args(md.decode_first_keys))
            self._write(*decodes, pages, fmt, spec, md.decode_block_table, md.decode_seq_lens, lse.t(), self.scale,
                        **self._window_args())
        start = md.query_start_loc[nd]
        if start < t:
            if self._prompt_kernel is not None and md.token_rows is not None:
                self._prompt_kernel(q[start:], k[start:], v[start:], pages, fmt, spec, md.token_rows,
                                    md.chunk_writes(fmt, spec), self.scale, out[start:], **self._window_args())
            else:
                out[start:] = salient_torch.attend_and_write(
                    q[start:], k[start:], v[start:], pages, fmt, spec, [x - start for x in md.query_start_loc[nd:]],
                    md.seq_lens[nd:], md.block_table[nd:], self.scale, self.sliding_window)

    def _forward_merged(self, layer, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                        fmt: MergedPairFormat, md: KVCompressMetadata, out: torch.Tensor) -> None:
        """A layer of a merged pair: the step's own tokens attend with their new K/V, earlier ones
        restored from the pair's pages (decodes and prompt chunks through the planned kernels where
        there are some); after the second layer's attention, both layers' new tokens go into the
        pages together."""
        self._warm_up(pages, q.dtype)
        t = q.shape[0]
        k, v = (x[:t].view(t, self.num_kv_heads, self.head_size) for x in (key, value))
        nd = md.num_decodes if self._decode_kernel is not None else 0
        if nd:
            self._decode_kernel(q[:nd], k[:nd], v[:nd], pages, fmt, self._pair_layer, md.decode_block_table,
                                md.decode_history_lens, self.scale, self._longest_decode(md), out[:nd],
                                row_order=md.decode_row_order)
        start = md.query_start_loc[nd]
        if start < t:
            if self._prompt_kernel is not None and md.token_rows is not None:
                self._prompt_kernel(q[start:], k[start:], v[start:], pages, fmt, self._pair_layer, md.token_rows,
                                    self.scale, out[start:])
            else:
                out[start:] = paged_torch.attend_pair(q[start:], pages, fmt, self._pair_layer,
                                                      [x - start for x in md.query_start_loc[nd:]], md.seq_lens[nd:],
                                                      md.block_table[nd:], self.scale, k[start:], v[start:],
                                                      self.sliding_window)
        if self._pair_layer == 1:  # the slots cover the step's tokens and its padding (-1), as key's rows do
            k_a, v_a, slots = _pair_tokens.pop(self.kv_sharing_target_layer_name)
            n = slots.shape[0]
            self._write(pages, fmt, k_a, v_a, key[:n].view(n, self.num_kv_heads, -1),
                        value[:n].view(n, self.num_kv_heads, -1), slots)


# A merged pair's first layer's new tokens, by its layer name, until the second layer writes both.
_pair_tokens: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

