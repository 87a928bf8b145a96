"""vLLM plugin entry point: registration and the hooks that turn compression on.

``register`` runs in every vLLM process (front end, engine core, workers). It
must be idempotent and must not touch the GPU. With no ``kv_compression``
setting every hook passes straight through, so an installed but unconfigured
plugin leaves vLLM as it is.
"""

from __future__ import annotations

import logging

from .engine_config import (
    ADDITIONAL_CONFIG_KEY,
    ModelKVShape,
    active_config,
    capacity_report,
    kernel_report,
    layer_page_format,
    platform_device,
    requested_setting,
    validate_against_model,
)

logger = logging.getLogger("vllm.kvcompress")  # under "vllm" so vLLM's log handlers print it
BACKEND_PATH = "vllm_kvcompress.backend.KVCompressBackend"
_installed = False


def register() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if "KVCOMPRESS" not in AttentionBackendEnum.__members__:
        register_backend("KVCOMPRESS", BACKEND_PATH)
    _add_cli_flag()
    _one_line_config_errors()
    _hook_platform()
    _hook_layer_spec()
    _hook_merged_pairs()
    _hook_weight_loading()


# --- the --kv-compression flag -------------------------------------------------

def _add_cli_flag() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original_add = EngineArgs.add_cli_args
    original_from = EngineArgs.from_cli_args.__func__

    def add_cli_args(parser, *args, **kwargs):
        parser = original_add(parser, *args, **kwargs)
        if not any("--kv-compression" in a.option_strings for a in parser._actions):
            parser.add_argument(
                "--kv-compression", default=None, metavar="CONFIG", type=_loadable_setting,
                help="vllm-kvcompress: store the KV cache in compressed pages. CONFIG is a YAML/JSON "
                     "file or a preset name (quant-k8v8, quant-k4v4, quant-k2v2, ...). Same as "
                     f"--additional-config '{{\"{ADDITIONAL_CONFIG_KEY}\": CONFIG}}'.")
        return parser

    def from_cli_args(cls, args):
        engine_args = original_from(cls, args)
        setting = getattr(args, "kv_compression", None)
        if setting is not None:
            engine_args.additional_config = with_compression(engine_args.additional_config, setting)
        return engine_args

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    _unwrap_config_errors(EngineArgs)


def _loadable_setting(setting: str) -> str:
    """The flag's value, once it loads: a bad file stops the command while its arguments are
    parsed, before ``vllm serve`` binds its port or loads a model."""
    import argparse

    from .config import KVCompressionConfigError, load_config

    try:
        load_config(setting)
    except KVCompressionConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return setting


def _one_line_config_errors() -> None:
    """A setting refused at startup and left uncaught (``vllm serve``, ``vllm bench``, a script) ends
    the process with its one line, ``error: ...``, not a traceback through vLLM's startup; any
    other exception keeps Python's report."""
    import sys

    from .config import KVCompressionConfigError

    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if issubclass(kind, KVCompressionConfigError):
            print(f"error: {value}", file=sys.stderr)
        else:
            previous(kind, value, traceback)

    sys.excepthook = excepthook


def _unwrap_config_errors(engine_args_cls) -> None:
    """Our startup checks run inside VllmConfig's validation, which wraps them in a long
    pydantic error; raise our one-line message instead."""
    from pydantic import ValidationError

    from .config import KVCompressionConfigError

    original = engine_args_cls.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except ValidationError as exc:
            ours = [e.get("ctx", {}).get("error") for e in exc.errors()]
            ours = [e for e in ours if isinstance(e, KVCompressionConfigError)]
            if ours:
                raise ours[0] from None
            raise

    engine_args_cls.create_engine_config = create_engine_config


def with_compression(additional_config, setting) -> dict:
    """``additional_config`` with ``kv_compression`` set; refuses two different settings."""
    extra = dict(additional_config or {})  # vLLM has already parsed --additional-config's JSON
    previous = extra.get(ADDITIONAL_CONFIG_KEY)
    if previous is not None and previous != setting:
        from .config import KVCompressionConfigError
        raise KVCompressionConfigError(
            f"--kv-compression {setting!r} conflicts with --additional-config "
            f"{ADDITIONAL_CONFIG_KEY}={previous!r}: give it once")
    extra[ADDITIONAL_CONFIG_KEY] = setting
    return extra


# --- platform: startup checks and backend choice ------------------------------

def _hook_platform() -> None:
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    original_check = platform_cls.check_and_update_config.__func__
    original_select = platform_cls.get_attn_backend_cls.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.v1.attention.selector import _cached_get_attn_backend

        original_check(cls, vllm_config)
        # The backend choice is cached per process; an earlier engine here may have had another setting.
        _cached_get_attn_backend.cache_clear()
        if requested_setting(vllm_config) is not None and vllm_config.model_config is not None:
            activate(vllm_config)

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        if (vllm_config is not None and requested_setting(vllm_config) is not None
                and not attn_selector_config.use_mla and attn_selector_config.attn_type == "decoder"):
            return BACKEND_PATH
        return original_select(cls, selected_backend, attn_selector_config, *args, **kwargs)

    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def activate(vllm_config) -> None:
    """Resolve and check the setting once per engine, and say what it does."""
    cfg = active_config(vllm_config)
    validate_against_model(cfg, vllm_config)
    cache_config = vllm_config.cache_config
    if not cache_config.user_specified_block_size:
        from .backend import PAGE_TOKENS
        cache_config.block_size = PAGE_TOKENS  # what vLLM asks the backend for later; the report below uses it
    vllm_config.additional_config[ADDITIONAL_CONFIG_KEY] = cfg.model_dump(mode="json") | {"source": cfg.source}
    shape = ModelKVShape.of(vllm_config)
    kernels = kernel_report(cfg, shape, platform_device())
    ratio, line = capacity_report(cfg, shape)
    logger.info("%s (config: %s)", line, cfg.source)
    logger.info("\n".join(kernels))
    vllm_config.additional_config["kv_compression_capacity_ratio"] = round(ratio, 4)


# --- per-layer page sizes ------------------------------------------------------

def _hook_layer_spec() -> None:
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    original = Attention.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        cfg = active_config(vllm_config)
        if cfg is None or not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)) or spec.state_content_bytes is not None:
            return spec
        from vllm.model_executor.models.utils import extract_layer_index

        from .backend import compressed_spec
        if cfg.merge is not None:
            _give_pairs_their_specs()
        fmt = layer_page_format(cfg, extract_layer_index(self.layer_name),
                                vllm_config.model_config.get_total_num_hidden_layers(), spec.dtype, spec.block_size,
                                spec.num_kv_heads, spec.head_size)
        return compressed_spec(spec, fmt)

    Attention.get_kv_cache_spec = get_kv_cache_spec


# --- MiniCache: a merged pair's second layer reads the first one's pages --------

def _hook_merged_pairs() -> None:
    """The second layer of each merged pair is built sharing the first one's cache tensor (vLLM's
    ``kv_sharing_target_layer_name``): vLLM then gives it no cache and no cache update of its own,
    and the backend writes both layers' tokens when the second one runs."""
    from vllm.model_executor.layers.attention.attention import Attention

    original = Attention.__init__

    def __init__(self, *args, prefix: str = "", **kwargs):
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        cfg = active_config(vllm_config) if vllm_config is not None else None
        if cfg is not None and cfg.merge is not None and kwargs.get("kv_sharing_target_layer_name") is None:
            kwargs["kv_sharing_target_layer_name"] = _pair_target(cfg, prefix, vllm_config)
        original(self, *args, prefix=prefix, **kwargs)

    Attention.__init__ = __init__


def _give_pairs_their_specs() -> None:
    """vLLM adds a cache-sharing layer to its target's group by name only; where the group's layers
    have pages of different sizes (``UniformTypeKVCacheSpecs``, as single layers beside merged pairs
    have), its model runners then look the sharing layer's spec up and fail. Give it its target's
    spec: ``add_kv_sharing_layers_to_kv_cache_groups`` is wrapped where it is defined and in every
    worker module that has imported it (called from the spec hook, in the worker, once)."""
    import sys

    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    from vllm.v1.worker import utils

    original = utils.add_kv_sharing_layers_to_kv_cache_groups
    if getattr(original, "_kvcompress", False):
        return

    def add_kv_sharing_layers_to_kv_cache_groups(shared_kv_cache_layers, kv_cache_groups, *args, **kwargs):
        original(shared_kv_cache_layers, kv_cache_groups, *args, **kwargs)
        for group in kv_cache_groups:
            specs = group.kv_cache_spec
            if isinstance(specs, UniformTypeKVCacheSpecs):
                for layer, target in shared_kv_cache_layers.items():
                    if target in specs.kv_cache_specs:
                        specs.kv_cache_specs[layer] = specs.kv_cache_specs[target]

    add_kv_sharing_layers_to_kv_cache_groups._kvcompress = True
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.v1.worker") and getattr(module, "add_kv_sharing_layers_to_kv_cache_groups",
                                                         None) is original:
            module.add_kv_sharing_layers_to_kv_cache_groups = add_kv_sharing_layers_to_kv_cache_groups


def _pair_target(cfg, prefix: str, vllm_config) -> str | None:
    """The layer name whose cache ``prefix``'s layer shares: its pair's first layer, if it is a second."""
    import re

    from vllm.model_executor.models.utils import extract_layer_index

    index = extract_layer_index(prefix)
    for a, b in cfg.merged_pairs(vllm_config.model_config.get_total_num_hidden_layers()):
        if index == b:
            return re.sub(rf"\.{b}\.", f".{a}.", prefix, count=1)
    return None


# --- slim attention's W_KV and v_rotation's turn, once the weights are in ---------

def _hook_weight_loading() -> None:
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading

    def process_weights_after_loading(model, model_config, target_device):
        # Before the original: on the CPU it may repack linear weights and drop qkv_proj.weight.
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        cfg = active_config(vllm_config) if vllm_config is not None else None
        if cfg is not None and cfg.uses_k_only(model_config.get_total_num_hidden_layers()):
            from .slim_loader import attach_slim_layers
            n = attach_slim_layers(model, cfg, model_config.dtype)
            logger.info("kv-compression slim: W_KV attached to %d layers; their pages hold K only", n)
        if cfg is not None:
            from .v_rotation_loader import fold_v_rotation
            n = fold_v_rotation(model, cfg)
            if n:
                logger.info("kv-compression v_rotation: V's Hadamard turn folded into the V and output "
                            "projections of %d layers; their pages hold V turned", n)
        original(model, model_config, target_device)

    base_loader.process_weights_after_loading = process_weights_after_loading
