"""Attaching slim attention's W_KV to each K-only layer when the model's weights are loaded.

W_KV comes from the checkpoint's own K and V projections (inverted in float64,
then cast to the model dtype), or from a file written by ``kvcompress
slim-weights`` (``slim_weights:`` in the config), which skips the inversion.
Each attention layer then carries a ``SlimLayer`` as ``kvcompress_slim``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .attention_layers import attention_layers, kv_rows
from .config import KVCompressionConfig, KVCompressionConfigError
from .slim import Rotary, SlimLayer, check_conditioning, load_weights, max_amplification, w_kv_from_projections

ATTRIBUTE = "kvcompress_slim"


def _k_and_v_weights(parent, attn, layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    qkv = getattr(parent, "qkv_proj", None)
    if qkv is None:
        raise KVCompressionConfigError(
            f"kv-compression slim: {layer_name} has no fused qkv_proj to read W_K and W_V from")
    if getattr(qkv, "bias", None) is not None:
        raise KVCompressionConfigError(
            f"kv-compression slim: {layer_name} has a K/V projection bias, which slim attention does not "
            "handle (allowed: attention without bias)")
    k_rows, v_rows = kv_rows(attn)
    return qkv.weight[k_rows], qkv.weight[v_rows]


def _rotary_of(parent, layer_name: str) -> Rotary:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    rope = getattr(parent, "rotary_emb", None)
    if not isinstance(rope, RotaryEmbedding):
        raise KVCompressionConfigError(
            f"kv-compression slim: {layer_name} uses {type(rope).__name__} positions; allowed: plain "
            "rotary embeddings (RotaryEmbedding and its scaled variants)")
    return Rotary(rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style)


def attach_slim_layers(model: torch.nn.Module, cfg: KVCompressionConfig, dtype: torch.dtype) -> int:
    """Give every K-only attention layer of ``model`` its ``SlimLayer``; returns how many."""
    stored = load_weights(Path(cfg.slim_weights)) if cfg.slim_weights else None
    found = {index: (attn, parent) for index, attn, parent in attention_layers(model)
             if cfg.layer_format(index).k_only}
    w_kv, cond = {}, {}
    for index, (attn, parent) in sorted(found.items()):
        if stored is not None:
            if index not in stored[1]:
                raise KVCompressionConfigError(
                    f"kv-compression config {cfg.source}: field 'slim_weights' = {cfg.slim_weights!r} has no "
                    f"W_KV for layer {index} (it has layers {sorted(stored[1])})")
            w_kv[index], cond[index] = stored[0].get(index), stored[1][index]
        else:
            w_kv[index], cond[index] = w_kv_from_projections(*_k_and_v_weights(parent, attn, attn.layer_name))
    if not found:
        return 0
    limit = cfg.slim_max_amplification or min(max_amplification(cfg.layer_format(i).k_bits, dtype) for i in found)
    check_conditioning(cond, limit, cfg.slim_weights or "computed from the checkpoint")
    for index, (attn, parent) in found.items():
        size = attn.num_kv_heads * attn.head_size
        if tuple(w_kv[index].shape) != (size, size):
            raise KVCompressionConfigError(
                f"kv-compression config {cfg.source}: W_KV of layer {index} in {cfg.slim_weights!r} is "
                f"{tuple(w_kv[index].shape)}, the model needs ({size}, {size})")
        device = next(parent.parameters()).device
        setattr(attn, ATTRIBUTE, SlimLayer.from_w_kv(w_kv[index].to(device=device, dtype=dtype), attn.num_heads,
                                                     _rotary_of(parent, attn.layer_name)))
    return len(found)
