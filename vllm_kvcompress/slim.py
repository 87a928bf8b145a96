"""Slim attention: K-only pages for multi-head attention, V rebuilt from K.

For MHA with a square, invertible ``W_K`` (all heads together), ``V = K W_KV``
with ``W_KV = W_K^-1 W_V``, where ``K = x W_K`` and ``V = x W_V`` are the
projections before RoPE. Pages keep K as the model computed it (after RoPE, so
scores read it unchanged); the value side rotates it back, ``K_pre = RoPE^-1(K)``.
Head i's output is ``(softmax(q_i K_i^T) K_pre) W_KV[:, i]``: the weighted sum of
whole K rows first, then one ``[H*D, D]`` product, so V is never materialized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("vllm.kvcompress")

# W_KV's error grows with cond(W_K) times the rounding of the stored K: above this,
# K's own float rounding (and more so a quantized K) no longer leaves V usable.
MAX_CONDITION_NUMBER = 1e5


@dataclass(frozen=True)
class Rotary:
    """The model's RoPE, as its cos/sin table: ``cos_sin[pos] = [cos | sin]`` over ``rotary_dim / 2``."""

    cos_sin: torch.Tensor
    rotary_dim: int
    neox: bool  # rotate halves (NeoX/Llama) or adjacent pairs (GPT-J)

    def unrotate(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """k [L, H, D] after RoPE at ``positions`` -> before RoPE (float32)."""
        cos, sin = self.cos_sin.index_select(0, positions).float().chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        k = k.float()
        rot, rest = k[..., :self.rotary_dim], k[..., self.rotary_dim:]
        if self.neox:
            a, b = rot.chunk(2, dim=-1)
            rot = torch.cat([a * cos + b * sin, b * cos - a * sin], dim=-1)
        else:
            a, b = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack([a * cos + b * sin, b * cos - a * sin], dim=-1).flatten(-2)
        return torch.cat([rot, rest], dim=-1)


@dataclass(frozen=True)
class SlimLayer:
    """What one layer needs to rebuild V: ``w_heads[i] = W_KV[:, i*D:(i+1)*D]`` ([H, H*D, D]) and the model's RoPE."""

    w_heads: torch.Tensor
    rotary: Rotary

    @classmethod
    def from_w_kv(cls, w_kv: torch.Tensor, num_heads: int, rotary: Rotary) -> "SlimLayer":
        size = w_kv.shape[0]
        return cls(w_kv.view(size, num_heads, size // num_heads).transpose(0, 1).contiguous(), rotary)

    def values_from(self, weights: torch.Tensor, k_post: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Head i's ``sum_j weights[i, :, j] V_j,i`` for weights [H, q, L] over keys ``k_post`` [L, H, D]
        at ``positions``, computed as ``(weights_i K_pre) W_KV[:, i]``. Returns [H, q, D]."""
        k_pre = self.rotary.unrotate(k_post, positions).flatten(1)  # [L, H*D]
        mixed = weights @ k_pre  # [H, q, H*D]
        return mixed @ self.w_heads.float()


def w_kv_from_projections(w_k: torch.Tensor, w_v: torch.Tensor) -> tuple[torch.Tensor | None, float]:
    """(W_KV float64, condition number of W_K) from ``nn.Linear`` weights [H*D, hidden] of K and V;
    W_KV is None where W_K is too badly conditioned to invert (see ``MAX_CONDITION_NUMBER``).

    With ``K = x A_K`` and ``V = x A_V`` (``A = W.T``, square), ``V = K A_K^-1 A_V``.
    """
    a_k, a_v = w_k.double().T, w_v.double().T
    cond = torch.linalg.cond(a_k).item()
    if not cond < MAX_CONDITION_NUMBER:
        return None, cond
    return torch.linalg.solve(a_k, a_v), cond


def save_weights(path: Path, w_kv: dict[int, torch.Tensor], cond: dict[int, float], model: str) -> None:
    torch.save({"model": model, "w_kv": w_kv, "cond": cond}, path)


def load_weights(path: Path) -> tuple[dict[int, torch.Tensor], dict[int, float]]:
    data = torch.load(path, map_location="cpu", weights_only=True)
    return data["w_kv"], data["cond"]


def check_conditioning(cond: dict[int, float], source: str) -> None:
    """Log each layer's cond(W_K); refuse the ill-conditioned ones, naming them."""
    from .config import KVCompressionConfigError

    worst = max(cond, key=cond.get)
    logger.info("kv-compression slim: cond(W_K) over %d layers: min %.3g, max %.3g (layer %d); limit %.0e (%s)",
                len(cond), min(cond.values()), cond[worst], worst, MAX_CONDITION_NUMBER, source)
    bad = {i: c for i, c in sorted(cond.items()) if not c < MAX_CONDITION_NUMBER}
    if bad:
        listed = ", ".join(f"layer {i}: {c:.3g}" for i, c in bad.items())
        raise KVCompressionConfigError(
            f"kv-compression slim: W_K is singular or badly conditioned ({listed}); allowed: condition "
            f"number below {MAX_CONDITION_NUMBER:.0e}. Keep these layers uncompressed with "
            "'full_precision_layers' or use another format for them")
