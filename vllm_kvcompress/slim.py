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

# Rebuilding V multiplies the stored K's rounding by W_KV. For rounding noise of relative
# size u on K (isotropic), V's expected relative error is u * amplification, with
# amplification = ||W_K||_F ||W_KV||_F / (sqrt(n) ||W_V||_F) (at most cond(W_K);
# docs/slim.md checks it against measured errors). A layer is refused where the
# expected error passes V_ERROR_LIMIT.
V_ERROR_LIMIT = 0.05
SINGULAR = 1e12  # cond(W_K) past this: numerically singular in float64, no W_KV at all


def k_rounding(k_bits: int, dtype: torch.dtype) -> float:
    """Relative RMS error of K as stored: rounding to the dtype (eps / sqrt(12)), or a ``k_bits`` grid
    over a channel's range in a block (about 5.2 standard deviations for 128 Gaussian values, so
    1.5 / (2^bits - 1)). docs/slim.md checks both against measurements."""
    if k_bits == 16:
        return torch.finfo(dtype).eps / 12 ** 0.5
    return 1.5 / (2 ** k_bits - 1)


def max_amplification(k_bits: int, dtype: torch.dtype) -> float:
    return V_ERROR_LIMIT / k_rounding(k_bits, dtype)


@dataclass(frozen=True)
class Conditioning:
    cond: float           # cond(W_K), 2-norm
    amplification: float  # expected growth of K's relative rounding in the rebuilt V


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

    def values(self, k_post: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """V [L, H, D] in ``dtype`` of keys ``k_post`` [L, H, D] at ``positions``: ``RoPE^-1(K) W_KV``,
        one matrix product in ``dtype`` (what a prompt chunk's history needs, as FlashAttention's V)."""
        k_pre = self.rotary.unrotate(k_post, positions).flatten(1).to(dtype)  # [L, H*D]
        return torch.matmul(k_pre, self.w_heads.to(dtype)).transpose(0, 1)  # [H, L, D] -> [L, H, D]


# The condition number's estimate (``condition_number``): block power iteration, this many vectors
# and steps (Gaussian matrices, the slowest case: within 0.2% of the SVD's at 512 wide, 1% at 4,096).
CONDITION_BLOCK, CONDITION_STEPS = 8, 20


def condition_number(a: torch.Tensor, lu: torch.Tensor, pivots: torch.Tensor) -> float:
    """cond(a) in the 2-norm, ``sigma_max / sigma_min``, estimated by block power iteration on ``A^T A``
    and on its inverse through ``a``'s LU factors (``lu``, ``pivots``), then the largest Ritz value of
    each: a few products with ``a`` and triangular solves, where the SVD of a 4,096-wide matrix cost
    2.5x the whole of this route on a CPU (docs/slim.md)."""

    def gram(x):  # A^T A x
        return a.T @ (a @ x)

    def inverse_gram(x):  # (A^T A)^-1 x = A^-1 A^-T x
        return torch.linalg.lu_solve(lu, pivots, torch.linalg.lu_solve(lu, pivots, x, adjoint=True))

    gen = torch.Generator(device=a.device).manual_seed(0)
    start = torch.randn(a.shape[0], CONDITION_BLOCK, dtype=a.dtype, device=a.device, generator=gen)
    largest = []
    for product in (gram, inverse_gram):
        x = start
        for _ in range(CONDITION_STEPS):
            x = torch.linalg.qr(product(x)).Q
        largest.append(torch.linalg.eigvalsh(x.T @ product(x)).max())  # sigma_max^2, then 1 / sigma_min^2
    return (largest[0] * largest[1]).sqrt().item()


def w_kv_from_projections(w_k: torch.Tensor, w_v: torch.Tensor) -> tuple[torch.Tensor | None, Conditioning]:
    """(W_KV float64, its conditioning) from ``nn.Linear`` weights [H*D, hidden] of K and V;
    W_KV is None where W_K is numerically singular.

    With ``K = x A_K`` and ``V = x A_V`` (``A = W.T``, square), ``V = K A_K^-1 A_V``.
    """
    a_k, a_v = w_k.double().T, w_v.double().T
    lu, pivots, info = torch.linalg.lu_factor_ex(a_k)
    cond = condition_number(a_k, lu, pivots) if info.item() == 0 else float("inf")  # info > 0: a zero pivot
    if not cond < SINGULAR:
        return None, Conditioning(cond, float("inf"))
    w_kv = torch.linalg.lu_solve(lu, pivots, a_v)
    amplification = (a_k.norm() * w_kv.norm() / (a_k.shape[0] ** 0.5 * a_v.norm())).item()
    return w_kv, Conditioning(cond, amplification)


def save_weights(path: Path, w_kv: dict[int, torch.Tensor], cond: dict[int, Conditioning], model: str) -> None:
    torch.save({"model": model, "w_kv": w_kv, "cond": {i: c.cond for i, c in cond.items()},
                "amplification": {i: c.amplification for i, c in cond.items()}}, path)


def load_weights(path: Path) -> tuple[dict[int, torch.Tensor], dict[int, Conditioning]]:
    data = torch.load(path, map_location="cpu", weights_only=True)
    return data["w_kv"], {i: Conditioning(c, data["amplification"][i]) for i, c in data["cond"].items()}


def check_conditioning(cond: dict[int, Conditioning], limit: float, source: str) -> None:
    """Log each layer's cond(W_K); refuse layers whose rebuilt V would be off by more than
    V_ERROR_LIMIT (amplification at or above ``limit``), naming them."""
    from .config import KVCompressionConfigError

    worst = max(cond, key=lambda i: cond[i].cond)
    logger.info("kv-compression slim: cond(W_K) over %d layers: %.3g .. %.3g (layer %d); V error amplification "
                "up to %.3g, limit %.3g (%s)", len(cond), min(c.cond for c in cond.values()), cond[worst].cond,
                worst, max(c.amplification for c in cond.values()), limit, source)
    for i, c in sorted(cond.items()):
        logger.debug("kv-compression slim: layer %d cond(W_K) %.4g amplification %.4g", i, c.cond, c.amplification)
    bad = {i: c for i, c in sorted(cond.items()) if not c.amplification < limit}
    if bad:
        listed = ", ".join(f"layer {i}: cond {c.cond:.3g}, amplification {c.amplification:.3g}"
                           for i, c in bad.items())
        raise KVCompressionConfigError(
            f"kv-compression slim: W_K is singular or badly conditioned ({listed}); allowed: amplification below "
            f"{limit:.3g}, where the stored K's rounding would grow into more than {V_ERROR_LIMIT:.0%} expected "
            "error in the rebuilt V. Keep these layers at 16 bits with 'full_precision_layers', store K in a "
            "finer format, or raise 'slim_max_amplification'")
