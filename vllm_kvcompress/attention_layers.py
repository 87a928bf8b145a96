"""A loaded model's attention layers, as the weight-loading hooks change them (``slim_loader``,
``v_rotation_loader``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def attention_layers(model: torch.nn.Module) -> Iterator[tuple[int, object, torch.nn.Module]]:
    """Each attention layer of ``model``: its index, its vLLM ``Attention`` and the module that holds
    it with its projections (``qkv_proj``, ``o_proj``, ``rotary_emb``)."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index

    for _, parent in model.named_modules():
        attn = getattr(parent, "attn", None)
        if isinstance(attn, Attention):
            yield extract_layer_index(attn.layer_name), attn, parent


def kv_rows(attn) -> tuple[slice, slice]:
    """K's and V's rows of a fused ``qkv_proj`` weight or bias, which holds this shard's heads' Q,
    then K, then V."""
    q_size, kv_size = attn.num_heads * attn.head_size, attn.num_kv_heads * attn.head_size
    return slice(q_size, q_size + kv_size), slice(q_size + kv_size, q_size + 2 * kv_size)
