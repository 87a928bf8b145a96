"""``v_rotation``: V's Hadamard turn folded into the model's weights when they are loaded.

Each layer that keeps V turned gets its V projection's rows turned (``v H`` comes out of the
projection itself) and its output projection's columns turned back, head by head
(``o_proj(out H) = o_proj(out)`` with ``W_O H`` in place of ``W_O``); a V bias moves to the output
projection (``_move_v_bias``). Attention is linear in V, so the layer computes what it did before
and its pages hold turned V, at no cost per step: the backend and kernels never see the turn.
Needs unquantized projection weights (a fused ``qkv_proj`` and ``o_proj``) and a head size that is
a power of 2.
"""

from __future__ import annotations

import torch

from .attention_layers import attention_layers, kv_rows
from .config import KVCompressionConfig, KVCompressionConfigError, LayerFormat
from .formats.rotation import hadamard


def _refuse(layer_name: str, why: str, fmt: LayerFormat) -> KVCompressionConfigError:
    unturned = {k: v for k, v in fmt.model_dump(exclude_defaults=True).items() if k != "v_rotation"}
    flow = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in unturned.items())
    return KVCompressionConfigError(f"kv-compression v_rotation: {layer_name} {why} (allowed: v_rotation false, "
                                    f"e.g. a config with default: {{{flow}}})")


def _turn_rows(w: torch.Tensor, h: torch.Tensor) -> None:
    """``w`` [heads * n, in] in place: each head's n rows replaced by ``h`` times them."""
    w.copy_((h @ w.float().view(-1, h.shape[0], w.shape[1])).view(w.shape).to(w.dtype))


def _turn_columns(w: torch.Tensor, h: torch.Tensor) -> None:
    """``w`` [out, heads * n] in place: each head's n columns times ``h``."""
    w.copy_((w.float().view(w.shape[0], -1, h.shape[0]) @ h).view(w.shape).to(w.dtype))


def fold_into(parent: torch.nn.Module, attn, fmt: LayerFormat) -> None:
    """Turn ``parent``'s V projection and turn its output projection back, for ``attn``'s heads
    (those of this worker's shard under tensor parallelism); ``fmt``, the layer's format, names the
    unturned alternative where the turn cannot be folded."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    name, d = attn.layer_name, attn.head_size
    if d & (d - 1):
        raise _refuse(name, f"has head size {d}; a Hadamard matrix needs a power of 2", fmt)
    qkv, o = getattr(parent, "qkv_proj", None), getattr(parent, "o_proj", None)
    if qkv is None or o is None:
        raise _refuse(name, "has no fused qkv_proj and o_proj to fold the turn into", fmt)
    for proj in (qkv, o):
        if not isinstance(getattr(proj, "quant_method", None), UnquantizedLinearMethod):
            raise _refuse(name, f"has quantized weights ({type(proj.quant_method).__name__}); the turn is folded "
                                "into unquantized ones", fmt)
    _, v_rows = kv_rows(attn)
    with torch.no_grad():
        if qkv.bias is not None:
            if o.skip_bias_add:
                raise _refuse(name, "has a V bias and an output projection that leaves its bias to the model", fmt)
            _move_v_bias(qkv.bias[v_rows], o, d, attn.num_heads // attn.num_kv_heads)
        h = hadamard(d, qkv.weight.device)
        _turn_rows(qkv.weight[v_rows], h)
        _turn_columns(o.weight, h)


def _move_v_bias(v_bias: torch.Tensor, o, head_size: int, group: int) -> None:
    """The V projection's bias (this shard's, zeroed in place) moved to the output projection's:
    attention weights sum to 1, so each output row carries its KV head's bias whole, and ``W_O b``
    can be added after ``o_proj`` instead. The pages then hold V without a constant offset per
    channel, which each token's grid would otherwise have to span. Under tensor parallelism the
    shards' parts are summed (``o_proj`` adds its bias once, on the first rank)."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

    per_query_head = v_bias.float().view(-1, head_size).repeat_interleave(group, 0).flatten()
    moved = o.weight.float() @ per_query_head
    if get_tensor_model_parallel_world_size() > 1:
        moved = tensor_model_parallel_all_reduce(moved)
    if o.bias is None:
        o.bias = torch.nn.Parameter(moved.to(o.weight.dtype), requires_grad=False)
    else:
        o.bias.copy_((o.bias.float() + moved).to(o.bias.dtype))
    v_bias.zero_()


def fold_v_rotation(model: torch.nn.Module, cfg: KVCompressionConfig) -> int:
    """Fold the turn into every attention layer of ``model`` whose format has ``v_rotation``;
    returns how many."""
    folded = 0
    for index, attn, parent in attention_layers(model):
        fmt = cfg.layer_format(index)
        if fmt.v_rotation:
            fold_into(parent, attn, fmt)
            folded += 1
    return folded
