"""The ``--kv-compression`` configuration: what each layer stores.

A config comes from a YAML/JSON file, a preset name in ``configs/`` or an
inline dict. Every problem is reported as one :class:`KVCompressionConfigError`
naming the field, the value and what is allowed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator
from pydantic.fields import FieldInfo

BITS_ALLOWED = (2, 3, 4, 8, 16)
Bits = Literal[2, 3, 4, 8, 16]
# The presets: package data, the checkout's configs/ installed as this package (pyproject.toml).
_PRESET_PACKAGE = "vllm_kvcompress.configs"


class KVCompressionConfigError(ValueError):
    """A bad ``kv_compression`` setting, found before the engine starts."""


class LayerFormat(BaseModel):
    """How one layer's K and V are stored. 16 bits means uncompressed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    k_bits: Bits = 16
    v_bits: Bits = 16
    k_axis: Literal["channel", "token"] = Field(
        "channel", description="K scale/zero per channel over a block's tokens (KIVI), or per token")
    v_axis: Literal["channel", "token"] = Field(
        "token", description="V scale/zero per token (KIVI), or per channel over a block's tokens")
    v_channel_scaling: bool = Field(
        False, description="ZipCache channel-separable V: divide channels by sqrt(max|v|) before quantizing")
    k_only: bool = Field(
        False, description="Slim attention: store K only and rebuild V as K W_KV (multi-head attention only)")
    rpc_fraction: float = Field(
        0.0, ge=0.0, le=1.0,
        description="KVmix recent pivotal context: share of the newest tokens read at 16 bits")
    rpc_tokens: int = Field(
        0, ge=0, description="cap on the recent window in tokens (16-bit copies kept per page); 0 = no window")
    outlier_tokens: int = Field(
        0, ge=0, le=8,
        description="tokens a block and KV head keeps apart (8-bit K, 4-bit V), outside the block's statistics: "
                    "the most deviant K of the block's first write (the attention sink among them)")
    k_clip: bool = Field(
        False, description="K's grid per channel narrowed about its middle to the least squared error over the "
                           "block's first write (values beyond on the end levels); with outlier_tokens, which keep "
                           "the attention sink out of it")
    v_rotation: bool = Field(
        False, description="V's channels turned by an orthonormal Hadamard matrix before quantizing (QuaRot's), "
                           "folded into the V and output projections at load: a few large channels no longer set "
                           "every token's grid (head size a power of 2, unquantized weights)")
    k_codec: str | None = Field(
        None, description="a registered codec (formats.CODECS) that stores K; default: raw at 16 bits, minmax below")
    v_codec: str | None = Field(None, description="likewise for V")

    @model_validator(mode="after")
    def _consistent(self):
        if self.rpc_fraction > 0 and self.rpc_tokens == 0:
            raise ValueError("rpc_fraction > 0 needs rpc_tokens > 0 (the window's cap in tokens)")
        if self.k_only and self.v_bits != 16:
            raise ValueError(f"k_only stores no V, so v_bits = {self.v_bits} has no meaning (leave it at 16)")
        if self.k_only and self.has_recent_window:
            raise ValueError("k_only cannot be combined with a recent window (rpc_fraction)")
        if self.k_clip:
            if self.k_bits == 16 or self.k_axis != "channel" or self.k_codec is not None:
                raise ValueError(f"k_clip narrows min-max grids of K per channel; not with k_bits = {self.k_bits}, "
                                 f"k_axis = {self.k_axis!r}, k_codec = {self.k_codec!r} (allowed: k_bits below 16, "
                                 "k_axis 'channel', the default codec)")
            if not self.outlier_tokens:
                raise ValueError("k_clip needs outlier_tokens >= 1: a narrowed grid cuts the attention sink's K "
                                 "(SmolLM2 2/2 bits: +59% perplexity without outliers, +8% with one; docs/formats.md)")
        if self.v_rotation and (self.v_bits == 16 or self.k_only or self.v_axis != "token" or self.v_channel_scaling
                                or self.v_codec is not None):
            raise ValueError(f"v_rotation turns V before its per-token grids; not with v_bits = {self.v_bits}, "
                             f"k_only = {self.k_only}, v_axis = {self.v_axis!r}, v_channel_scaling = "
                             f"{self.v_channel_scaling}, v_codec = {self.v_codec!r} (allowed: v_bits below 16, "
                             "v_axis 'token', the default codec, no channel scaling, not k_only)")
        if self.outlier_tokens:
            if self.k_bits == 16:
                raise ValueError(f"outlier_tokens = {self.outlier_tokens} needs quantized K (k_bits below 16)")
            if self.k_only or self.has_recent_window:
                raise ValueError(f"outlier_tokens = {self.outlier_tokens} cannot be combined with "
                                 f"{'k_only' if self.k_only else 'a recent window (rpc_fraction)'} (allowed: 0)")
        return self

    @property
    def is_uncompressed(self) -> bool:
        return self.k_bits == 16 and self.v_bits == 16 and not self.k_only

    @property
    def has_recent_window(self) -> bool:
        return self.rpc_tokens > 0 and self.rpc_fraction > 0 and not self.is_uncompressed

    def describe(self) -> str:
        if self.is_uncompressed:
            return "16-bit"
        if self.k_only:
            return f"K{self.k_bits}/{self.k_axis} only (V = K W_KV)"
        scaling = "+chscale" if self.v_channel_scaling and self.v_bits != 16 else ""
        window = f" +{self.rpc_fraction:.0%} recent (<= {self.rpc_tokens}) at 16-bit" if self.has_recent_window else ""
        extras = f" +{self.outlier_tokens} outlier token(s) a block at 8/4-bit" if self.outlier_tokens else ""
        extras += " +K grids clipped" if self.k_clip else ""
        extras += " +V rotated" if self.v_rotation else ""
        k_codec, v_codec = (f"[{c}]" if c else "" for c in (self.k_codec, self.v_codec))
        return (f"K{self.k_bits}/{self.k_axis}{k_codec} V{self.v_bits}/{self.v_axis}{v_codec}{scaling}{window}"
                f"{extras}")


def _overrides_of(model: type[BaseModel]) -> type[BaseModel]:
    """A model with every field of ``model`` optional (None: not overridden), same types and bounds:
    per-layer overrides follow the format model as it grows, and are checked when the file is read."""
    fields = {}
    for name, info in model.model_fields.items():
        optional = FieldInfo.merge_field_infos(info, default=None)
        optional.annotation = Optional[info.annotation]
        fields[name] = (Optional[info.annotation], optional)
    return create_model(f"{model.__name__}Override", __config__=ConfigDict(extra="forbid", frozen=True),
                        __doc__=f"Fields of :class:`{model.__name__}` that differ for one layer.", **fields)


LayerOverride = _overrides_of(LayerFormat)


class ModelIdentity(BaseModel):
    """The model a config was made for (a profiled config only fits its own model)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: str | None = None
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_size: int | None = None


class MergeSpec(BaseModel):
    """MiniCache: from ``start_layer`` on, layers (l, l + 1) keep one page of merged directions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start_layer: int | None = Field(None, ge=1, description="first merged layer S (default: half the model's layers)")
    t: float = Field(0.6, ge=0.0, le=1.0, description="SLERP weight of the pair's second layer (0.5: plain average)")
    gamma: float = Field(0.05, ge=0.0, le=0.5, description="share of a block's tokens kept unmerged, most distinct first")


class SalientSpec(BaseModel):
    """ZipCache: per block, the tokens the probe queries attend to most keep ``high_bits``, the rest ``low_bits``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ratio: float = Field(0.6, gt=0.0, le=1.0, description="share of each block's tokens kept at high_bits")
    high_bits: Literal[4] = 4
    low_bits: Literal[2] = 2
    score: Literal["normalized", "accumulated", "random"] = Field(
        "normalized", description="normalized attention (ZipCache), accumulated attention (H2O, MiKV), or random")
    probe_recent: float = Field(0.05, ge=0.0, le=1.0, description="share of a chunk's newest queries used as probes")
    probe_random: float = Field(0.05, ge=0.0, le=1.0, description="share of a chunk's other queries drawn as probes")
    recompress_interval: int = Field(
        100, ge=1, description="a decoding request's blocks are re-compressed every this many tokens")
    seed: int = Field(0, ge=0, description="seed of the random probes (and of score: random)")


class KVCompressionConfig(BaseModel):
    """A whole-model setting: a default format, per-layer overrides, and
    layers kept at 16 bits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "custom"
    description: str = ""
    model: ModelIdentity | None = None
    default: LayerFormat = LayerFormat()
    layers: dict[int, LayerOverride] = Field(default_factory=dict)
    full_precision_layers: list[int] = Field(default_factory=list)
    merge: MergeSpec | None = Field(None, description="MiniCache cross-layer merging (none: every layer its own pages)")
    salient: SalientSpec | None = Field(
        None, description="ZipCache mixed precision by token saliency (compressed layers: K and V at high_bits)")
    slim_weights: str | None = Field(
        None, description="file of precomputed W_KV (kvcompress slim-weights) for k_only layers")
    slim_max_amplification: float | None = Field(
        None, gt=1, description="accept k_only layers whose V error amplification is below this instead of the "
                                "limit derived from K's precision (e.g. for speed runs on random weights)")
    source: str = Field("inline", exclude=True)

    def layer_format(self, layer_index: int) -> LayerFormat:
        if layer_index in self.full_precision_layers:
            return LayerFormat()
        override = self.layers.get(layer_index)
        if override is None:
            return self.default
        changes = override.model_dump(exclude_none=True)
        try:
            return LayerFormat(**(self.default.model_dump() | changes))
        except ValidationError as err:
            raise KVCompressionConfigError(
                f"kv-compression config {self.source}: layer {layer_index}: {err.errors()[0]['msg']}") from None

    def merged_pairs(self, num_layers: int) -> list[tuple[int, int]]:
        """The layer pairs that share pages (MiniCache), first layer first."""
        if self.merge is None:
            return []
        start = num_layers // 2 if self.merge.start_layer is None else self.merge.start_layer
        return [(layer, layer + 1) for layer in range(start, num_layers - 1, 2)]

    def check_salient_layers(self, num_layers: int) -> None:
        """ZipCache pages hold K per channel and V per token on one ``high_bits`` grid; nothing else."""
        if self.salient is None:
            return
        if self.merge is not None:
            raise KVCompressionConfigError(
                f"kv-compression config {self.source}: fields 'salient' and 'merge' cannot be combined (allowed: one)")
        plain = LayerFormat(k_bits=self.salient.high_bits, v_bits=self.salient.high_bits)
        for i in range(num_layers):
            fmt = self.layer_format(i)
            if fmt.is_uncompressed:
                continue
            if fmt != plain:
                raise KVCompressionConfigError(
                    f"kv-compression config {self.source}: field 'salient' needs every compressed layer at "
                    f"{plain.describe()} (the high precision), but layer {i} is {fmt.describe()} "
                    "(allowed: that format, or 16 bits)")

    def uses_k_only(self, num_layers: int) -> bool:
        return any(self.layer_format(i).k_only for i in range(num_layers))

    def check_layers(self, num_layers: int) -> None:
        """Refuse layer indices the model doesn't have."""
        named = [("layers", i) for i in self.layers] + [("full_precision_layers", i) for i in self.full_precision_layers]
        for field, index in named:
            if not 0 <= index < num_layers:
                raise KVCompressionConfigError(
                    f"kv-compression config {self.source}: field '{field}' names layer {index}, "
                    f"but the model has {num_layers} attention layers (allowed: 0..{num_layers - 1})")


def _format_validation_error(source: str, err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    value = first.get("input")
    if first["type"] == "extra_forbidden":
        allowed = _allowed_keys_at(first["loc"])
        return f"kv-compression config {source}: unknown field '{loc}'; allowed fields here: {', '.join(allowed)}"
    if first["loc"] and first["loc"][-1] in ("k_bits", "v_bits"):
        allowed = ", ".join(map(str, BITS_ALLOWED))
        return f"kv-compression config {source}: field '{loc}' = {value!r} is not allowed; allowed: {allowed}"
    return f"kv-compression config {source}: field '{loc}' = {value!r}: {first['msg']}"


def _allowed_keys_at(loc: tuple) -> list[str]:
    model: type[BaseModel] = KVCompressionConfig
    for part in loc[:-1]:
        if part == "default":
            model = LayerFormat
        elif part == "layers":
            model = LayerOverride
        elif part == "model":
            model = ModelIdentity
        elif part == "merge":
            model = MergeSpec
        elif part == "salient":
            model = SalientSpec
    return sorted(k for k in model.model_fields if k != "source")


def _read_file(path: Path) -> Any:
    text = path.read_text()
    try:
        if path.suffix == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        first_line = str(exc).strip().splitlines()[0]
        raise KVCompressionConfigError(f"kv-compression config {path}: malformed {path.suffix.lstrip('.').upper() or 'YAML'}: {first_line}") from None


def preset_names() -> list[str]:
    from importlib.resources import files
    return sorted(p.name.removesuffix(".yaml") for p in files(_PRESET_PACKAGE).iterdir() if p.name.endswith(".yaml"))


def _preset_path(name: str) -> Path | None:
    from importlib.resources import files
    path = files(_PRESET_PACKAGE) / f"{name}.yaml"
    return Path(str(path)) if path.is_file() else None


def load_config(spec: str | dict | KVCompressionConfig) -> KVCompressionConfig:
    """Load a config from a path, a preset name, or a dict."""
    if isinstance(spec, KVCompressionConfig):
        return spec
    if isinstance(spec, dict):
        source = str(spec.get("source", "(inline)"))
        data = {k: v for k, v in spec.items() if k != "source"}
    elif isinstance(spec, str):
        path = Path(spec).expanduser()
        preset = _preset_path(spec)
        if path.is_file():
            source = str(path)
            data = _read_file(path)
        elif preset is not None:
            source = f"preset '{spec}'"
            data = _read_file(preset)
        else:
            raise KVCompressionConfigError(
                f"kv-compression config '{spec}': no such file, and not a preset name "
                f"(presets: {', '.join(preset_names())})")
    else:
        raise KVCompressionConfigError(
            f"kv_compression must be a file path, a preset name or a dict, got {type(spec).__name__}")
    if not isinstance(data, dict):
        raise KVCompressionConfigError(
            f"kv-compression config {source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return KVCompressionConfig(**data, source=source)
    except ValidationError as err:
        raise KVCompressionConfigError(_format_validation_error(source, err)) from None
