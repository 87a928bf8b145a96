"""Reading the compression setting out of a vLLM config, and sizing pages for it.

The setting travels to every vLLM process as ``additional_config["kv_compression"]``.
At startup it is resolved once (file or preset read, checked against the
model) and replaced by the resolved dict, so worker processes never read files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import KVCompressionConfig, KVCompressionConfigError, load_config
from .formats import KVPageFormat

ADDITIONAL_CONFIG_KEY = "kv_compression"


def requested_setting(vllm_config) -> object | None:
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict):
        return None
    return extra.get(ADDITIONAL_CONFIG_KEY)


def active_config(vllm_config) -> KVCompressionConfig | None:
    """The compression config in force for this engine, or None (plugin inert)."""
    setting = requested_setting(vllm_config)
    if setting is None:
        return None
    return load_config(setting)


@dataclass(frozen=True)
class ModelKVShape:
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int

    @classmethod
    def of(cls, vllm_config) -> "ModelKVShape":
        mc = vllm_config.model_config
        return cls(
            num_layers=mc.get_total_num_hidden_layers(),
            num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
            head_size=mc.get_head_size(),
            dtype=mc.dtype,
            block_size=vllm_config.cache_config.block_size,
        )

    def page_format(self, cfg: KVCompressionConfig, layer_index: int) -> KVPageFormat:
        return layer_page_format(cfg, layer_index, self.dtype, self.block_size, self.num_kv_heads,
                                 self.head_size)


def layer_page_format(cfg: KVCompressionConfig, layer_index: int, dtype: torch.dtype, block_size: int,
                      num_kv_heads: int, head_size: int) -> KVPageFormat:
    """The page one layer uses under ``cfg``."""
    try:
        return KVPageFormat.from_layer_format(cfg.layer_format(layer_index), dtype, block_size, num_kv_heads,
                                              head_size)
    except ValueError as err:
        if isinstance(err, KVCompressionConfigError):
            raise
        raise KVCompressionConfigError(f"kv-compression config {cfg.source}: layer {layer_index}: {err}") from None


def capacity_report(cfg: KVCompressionConfig, shape: ModelKVShape) -> tuple[float, str]:
    """(ratio of KV tokens vs. vLLM's 16-bit cache in the same memory, a log line)."""
    formats = [shape.page_format(cfg, i) for i in range(shape.num_layers)]
    ours = sum(f.page_bytes for f in formats)
    dense = sum(f.dense_page_bytes() for f in formats)
    counts: dict[str, int] = {}
    for i in range(shape.num_layers):
        d = cfg.layer_format(i).describe()
        counts[d] = counts.get(d, 0) + 1
    layers = ", ".join(f"{n} layers {d}" for d, n in counts.items())
    ratio = dense / ours
    line = (f"kv-compression '{cfg.name}': {layers}; block of {shape.block_size} tokens takes "
            f"{ours:,} B over all layers instead of {dense:,} B at 16 bits: {ratio:.2f}x KV tokens in the same memory")
    return ratio, line


def check_model_identity(cfg: KVCompressionConfig, vllm_config) -> None:
    """A config made for one model (``model:``, e.g. from the profiler) is refused on another."""
    if cfg.model is None:
        return
    mc = vllm_config.model_config
    served = {
        "architecture": (mc.architectures or [None])[0],
        "num_layers": mc.get_total_num_hidden_layers(),
        "num_kv_heads": mc.get_total_num_kv_heads(),
        "head_size": mc.get_head_size(),
    }
    for field, expected in cfg.model.model_dump(exclude_none=True).items():
        if served[field] != expected:
            raise KVCompressionConfigError(
                f"kv-compression config {cfg.source}: field 'model.{field}' = {expected!r}, but the served "
                f"model {mc.model} has {field} = {served[field]!r}: this config was made for another model")


def check_slim_fits(cfg: KVCompressionConfig, vllm_config) -> None:
    """K-only pages need V = K W_KV with a square W_K over all heads, on one device."""
    mc = vllm_config.model_config
    heads, kv_heads = mc.get_num_attention_heads(vllm_config.parallel_config), mc.get_total_num_kv_heads()
    total_heads = getattr(mc.hf_text_config, "num_attention_heads", heads)
    if kv_heads != total_heads:
        raise KVCompressionConfigError(
            f"kv-compression config {cfg.source}: k_only (slim attention) needs multi-head attention, but "
            f"{mc.model} has {total_heads} query heads and {kv_heads} KV heads (grouped-query): W_K is not square")
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp > 1:
        raise KVCompressionConfigError(
            f"kv-compression config {cfg.source}: k_only (slim attention) with --tensor-parallel-size {tp}: "
            "each head's V needs the K of every head, which is split across GPUs (allowed: 1)")
    window = getattr(mc.hf_text_config, "sliding_window", None)
    if window:
        raise KVCompressionConfigError(
            f"kv-compression config {cfg.source}: k_only (slim attention) with sliding-window attention "
            f"(sliding_window={window}) is not supported")
    if getattr(mc.hf_text_config, "attention_bias", False):
        raise KVCompressionConfigError(
            f"kv-compression config {cfg.source}: k_only (slim attention) needs attention without bias, "
            f"but {mc.model} has attention_bias=true")


CUDA_DTYPES = (torch.float16, torch.bfloat16)


def check_cuda_kernels(cfg: KVCompressionConfig, shape: ModelKVShape) -> list[str]:
    """On CUDA: refuse shapes and dtypes the Triton kernels cannot read; return the layers that
    decode through the torch reference path instead (formats without a kernel yet), with why."""
    from .triton_kernels.layout import kernel_supports

    if shape.dtype not in CUDA_DTYPES:
        raise KVCompressionConfigError(
            f"--dtype {shape.dtype} is not supported with --kv-compression on CUDA (allowed: float16, bfloat16)")
    d = shape.head_size
    if d & (d - 1) or not 64 <= d <= 256:
        raise KVCompressionConfigError(
            f"kv-compression config {cfg.source}: the model's head size {d} is not supported by the CUDA kernels "
            "(allowed: 64, 128, 256); KVCOMPRESS_KERNELS=torch runs the slow torch reference path instead")
    slow = []
    for i in range(shape.num_layers):
        fmt = shape.page_format(cfg, i)
        reason = None if fmt.v is None else kernel_supports(fmt)  # K-only layers: checked at load (RoPE)
        if reason is not None:
            slow.append(f"layer {i} ({reason})")
    return slow


def validate_against_model(cfg: KVCompressionConfig, vllm_config) -> None:
    """Refuse settings that cannot work with this model and engine, at startup."""
    mc = vllm_config.model_config
    check_model_identity(cfg, vllm_config)
    cfg.check_layers(mc.get_total_num_hidden_layers())
    if mc.use_mla:
        raise KVCompressionConfigError(
            f"kv-compression config {cfg.source}: model {mc.model} uses MLA attention, which is not supported "
            "(supported: multi-head and grouped-query attention)")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise KVCompressionConfigError(
            f"--kv-cache-dtype {cache_dtype} cannot be combined with --kv-compression: "
            "the compressed pages replace vLLM's cache dtype (allowed: --kv-cache-dtype auto)")
    if cfg.uses_k_only(mc.get_total_num_hidden_layers()):
        check_slim_fits(cfg, vllm_config)
    if mc.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise KVCompressionConfigError(
            f"--dtype {mc.dtype} is not supported with --kv-compression (allowed: float16, bfloat16, float32)")
