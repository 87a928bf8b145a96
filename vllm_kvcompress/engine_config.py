"""Reading the compression setting out of a vLLM config, and sizing pages for it.

The setting travels to every vLLM process as ``additional_config["kv_compression"]``.
At startup it is resolved once (file or preset read, checked against the
model) and replaced by the resolved dict, so worker processes never read files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import policy
from .config import KVCompressionConfig, KVCompressionConfigError, load_config
from .formats import KVPageFormat
from .formats.merged import MergedPairFormat
from .formats.salient import SalientTokensFormat
from .kernels import registry

ADDITIONAL_CONFIG_KEY = "kv_compression"
PageFormat = KVPageFormat | MergedPairFormat | SalientTokensFormat


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
    num_query_heads: int = 0
    sliding_windows: tuple[int | None, ...] = ()  # by layer (empty: none)

    @classmethod
    def of(cls, vllm_config) -> "ModelKVShape":
        mc = vllm_config.model_config
        num_layers = mc.get_total_num_hidden_layers()
        return cls(
            num_layers=num_layers,
            num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
            head_size=mc.get_head_size(),
            dtype=mc.dtype,
            block_size=vllm_config.cache_config.block_size,
            num_query_heads=mc.get_num_attention_heads(vllm_config.parallel_config),
            sliding_windows=layer_sliding_windows(mc.hf_text_config, num_layers),
        )

    def sliding_window(self, layer_index: int) -> int | None:
        return self.sliding_windows[layer_index] if self.sliding_windows else None

    def page_format(self, cfg: KVCompressionConfig, layer_index: int) -> "PageFormat":
        return layer_page_format(cfg, layer_index, self.num_layers, self.dtype, self.block_size, self.num_kv_heads,
                                 self.head_size)

    def cache_owners(self, cfg: KVCompressionConfig) -> list[int]:
        """The layers with pages of their own: all but the second of each merged pair."""
        seconds = {b for _, b in cfg.merged_pairs(self.num_layers)}
        return [i for i in range(self.num_layers) if i not in seconds]

    def layer_context(self, layer_index: int, device: "registry.Device") -> "registry.LayerContext":
        return registry.LayerContext(device, self.dtype, self.num_query_heads, self.sliding_window(layer_index))


def layer_page_format(cfg: KVCompressionConfig, layer_index: int, num_layers: int, dtype: torch.dtype,
                      block_size: int, num_kv_heads: int, head_size: int) -> PageFormat:
    """The page one layer uses under ``cfg``: its own, or its merged pair's (both layers the same)."""
    try:
        if cfg.salient is not None and not cfg.layer_format(layer_index).is_uncompressed:
            return SalientTokensFormat.create(cfg.salient.ratio, dtype, block_size, num_kv_heads, head_size)
        for pair in cfg.merged_pairs(num_layers):
            if layer_index in pair:
                return MergedPairFormat.from_layer_format(cfg.layer_format(pair[0]), cfg.merge.t, cfg.merge.gamma,
                                                          dtype, block_size, num_kv_heads, head_size)
        return KVPageFormat.from_layer_format(cfg.layer_format(layer_index), dtype, block_size, num_kv_heads,
                                              head_size)
    except ValueError as err:
        if isinstance(err, KVCompressionConfigError):
            raise
        raise KVCompressionConfigError(f"kv-compression config {cfg.source}: layer {layer_index}: {err}") from None


def layer_sliding_windows(hf_text_config, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window as the Hugging Face config states it: ``layer_types`` where it
    names them (Gemma 3), else every layer or none (``use_sliding_window: false``, as Qwen2's)."""
    window = getattr(hf_text_config, "sliding_window", None)
    if not window or getattr(hf_text_config, "use_sliding_window", True) is False:
        return ()
    types = getattr(hf_text_config, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types[:num_layers])
    return (window,) * num_layers


def layer_plans(cfg: KVCompressionConfig, shape: ModelKVShape, device: "registry.Device") -> list["registry.LayerPlan"]:
    """What the kernel registry plans for each layer of a model on ``device``."""
    return [registry.plan(shape.page_format(cfg, i), shape.layer_context(i, device), policy.current())
            for i in range(shape.num_layers)]


def full_cuda_graphs(cfg: KVCompressionConfig, shape: ModelKVShape, device: "registry.Device") -> bool:
    """Whether a decode-only step runs without the host, so vLLM may capture it whole: every layer's
    planned decode can (``Implementation.cuda_graphs``), and no ZipCache layer draws its scores at
    random (drawn on the host, by each request's length)."""
    if cfg.salient is not None and cfg.salient.score == "random":
        return False
    return all(p.decode.implementation.cuda_graphs for p in layer_plans(cfg, shape, device))


def platform_device() -> "registry.Device":
    """The device this engine serves on, as the registry sees it, without initializing CUDA."""
    from vllm.platforms import current_platform
    if not current_platform.is_cuda():
        return registry.Device.of("cpu")
    cap = current_platform.get_device_capability()
    return registry.Device.of("cuda", None if cap is None else (cap.major, cap.minor))


def capacity_report(cfg: KVCompressionConfig, shape: ModelKVShape) -> tuple[float, str]:
    """(ratio of KV tokens vs. vLLM's own cache in the model's dtype in the same memory, a log line)."""
    formats = [shape.page_format(cfg, i) for i in shape.cache_owners(cfg)]
    ours = sum(f.page_bytes for f in formats)
    dense = sum(f.dense_page_bytes() for f in formats)
    counts: dict[str, int] = {}
    for i in range(shape.num_layers):
        d = layer_description(cfg, i, shape.num_layers)
        counts[d] = counts.get(d, 0) + 1
    layers = ", ".join(f"{n} layers {d}" for d, n in counts.items())
    ratio = dense / ours
    dtype = str(shape.dtype).removeprefix("torch.")
    line = (f"kv-compression '{cfg.name}': {layers}; block of {shape.block_size} tokens takes "
            f"{ours:,} B over all layers instead of {dense:,} B in {dtype}: {ratio:.2f}x KV tokens in the same memory")
    sizes = {f.page_bytes for f in formats}
    if len(set(shape.sliding_windows)) > 1 and len(sizes) > 1:
        line += (f"; but this model mixes sliding-window and full-attention layers, for which vLLM pads pages of "
                 f"different sizes ({min(sizes):,} to {max(sizes):,} B) to a common size: expect fewer KV tokens "
                 f"(vLLM's 'KV cache size' line counts them)")
    return ratio, line


def layer_description(cfg: KVCompressionConfig, layer_index: int, num_layers: int) -> str:
    fmt = cfg.layer_format(layer_index)
    if cfg.salient is not None and not fmt.is_uncompressed:
        s = cfg.salient
        return (f"K/channel V/token, {s.ratio:.0%} of each block's tokens at {s.high_bits} bits by {s.score} "
                f"attention, the rest at {s.low_bits}")
    merged = any(layer_index in pair for pair in cfg.merged_pairs(num_layers))
    suffix = f" merged in pairs (t={cfg.merge.t}, gamma={cfg.merge.gamma})" if merged else ""
    return fmt.describe() + suffix


def check_merge_fits(cfg: KVCompressionConfig, shape: ModelKVShape) -> None:
    """MiniCache pairs need two layers of one format and one attention window, without K-only pages,
    recent windows or rotated V."""
    if cfg.merge is None:
        return
    pairs = cfg.merged_pairs(shape.num_layers)
    if not pairs:
        raise KVCompressionConfigError(
            f"kv-compression config {cfg.source}: field 'merge.start_layer' = {cfg.merge.start_layer} leaves no pair "
            f"of layers to merge: the model has {shape.num_layers} attention layers "
            f"(allowed: 1..{shape.num_layers - 2})")
    for a, b in pairs:
        fa, fb = cfg.layer_format(a), cfg.layer_format(b)
        why = None
        if fa != fb:
            why = f"their formats differ ({fa.describe()} and {fb.describe()}; give both the same)"
        elif fa.k_only:
            why = "k_only layers (slim attention) cannot be merged"
        elif fa.has_recent_window:
            why = "a recent window (rpc_fraction) cannot be combined with merging"
        elif fa.v_rotation:
            why = "v_rotation cannot be combined with merging (allowed: false)"
        elif shape.sliding_window(a) != shape.sliding_window(b):
            windows = ["full attention" if w is None else f"a sliding window of {w}"
                       for w in (shape.sliding_window(a), shape.sliding_window(b))]
            why = f"{windows[0]} and {windows[1]} (a pair's layers must see the same tokens)"
        if why is not None:
            raise KVCompressionConfigError(f"kv-compression config {cfg.source}: merge pairs layers {a} and {b}: {why}")


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


def kernel_report(cfg: KVCompressionConfig, shape: ModelKVShape, device: "registry.Device") -> list[str]:
    """The startup log block: per run of layers with the same format and plan, what runs each
    operation and why any implementation was passed over. Refuses a model the device's kernels
    cannot serve at all."""
    why = registry.model_refusal(shape.dtype, shape.head_size, device, policy.current())
    if why is not None:
        raise KVCompressionConfigError(f"kv-compression config {cfg.source}: {why}")
    rows: list[list] = []  # [first, last, text]
    for i, plan in enumerate(layer_plans(cfg, shape, device)):
        text = f"{layer_description(cfg, i, shape.num_layers)}: {plan.describe()}"
        if rows and rows[-1][2] == text:
            rows[-1][1] = i
        else:
            rows.append([i, i, text])
    span = lambda a, b: f"layer {a}" if a == b else f"layers {a}-{b}"  # noqa: E731
    return [f"kv-compression kernels on {device.type}:"] + [f"  {span(a, b)}: {text}" for a, b, text in rows]


def validate_against_model(cfg: KVCompressionConfig, vllm_config) -> None:
    """Refuse settings that cannot work with this model and engine, at startup."""
    mc = vllm_config.model_config
    check_model_identity(cfg, vllm_config)
    cfg.check_layers(mc.get_total_num_hidden_layers())
    cfg.check_salient_layers(mc.get_total_num_hidden_layers())
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
    check_merge_fits(cfg, ModelKVShape.of(vllm_config))
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if cfg.merge is not None and pp > 1:
        raise KVCompressionConfigError(
            f"kv-compression config {cfg.source}: merge with --pipeline-parallel-size {pp}: a merged pair's two "
            "layers must run in one process (allowed: 1)")
    if mc.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise KVCompressionConfigError(
            f"--dtype {mc.dtype} is not supported with --kv-compression (allowed: float16, bfloat16, float32)")
