"""MiniCache: one page holds two adjacent layers' K and V as merged directions (a format over a
group of layers).

For each token and head, layer a's and layer b's vectors x_a, x_b are split into norms and unit
directions; the page keeps SLERP(u_a, u_b, t) once (through the layer format's codec, 16-bit or
quantized) and both layers' norms. Layer a is restored as direction times its norm, layer b
likewise. The block's tokens whose two directions differ most (a share ``gamma`` of the block, by
angular distance averaged over heads and over K and V) keep both layers' vectors unmerged in fixed
retention slots, with their token offsets. The paper (Liu et al., 2024) merges per token over the
whole vector and retains over the whole context; choices made here for fixed pages are in
docs/formats.md.

Page: K direction codes | V direction codes | norms [B, 2 layers, 2 (K, V), H] float16 | retained
token offsets [R] int16 (-1: empty) | retained vectors [R, 2 layers, 2 (K, V), H, D] in the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from .codecs import Codec, TensorSpec
from .layout import Regions, SlottedPage
from .page import codec_for

_EPS = 1e-6


def slerp(u: torch.Tensor, w: torch.Tensor, t: float) -> torch.Tensor:
    """Spherical interpolation between unit vectors along the last axis (linear where they coincide)."""
    cos = (u * w).sum(-1, keepdim=True).clamp(-1.0, 1.0)
    omega = torch.arccos(cos)
    sin = torch.sin(omega)
    near = sin < 1e-4
    a = torch.where(near, 1.0 - t, torch.sin((1.0 - t) * omega) / sin.clamp_min(1e-4))
    b = torch.where(near, t, torch.sin(t * omega) / sin.clamp_min(1e-4))
    return a * u + b * w


@dataclass(frozen=True)
class MergedPairFormat(SlottedPage):
    k: Codec  # the merged K directions
    v: Codec  # the merged V directions
    block_size: int
    dtype: torch.dtype
    t: float = 0.6
    gamma: float = 0.05

    @classmethod
    def from_layer_format(cls, fmt, t: float, gamma: float, dtype: torch.dtype, block_size: int, num_kv_heads: int,
                          head_size: int) -> "MergedPairFormat":
        """The pair's page when both layers have the layer format ``fmt`` (its codecs store the directions)."""
        shape = (dtype, block_size, num_kv_heads, head_size)
        k = codec_for("k_codec", TensorSpec(fmt.k_bits, fmt.k_axis, codec=fmt.k_codec), *shape)
        v = codec_for("v_codec", TensorSpec(fmt.v_bits, fmt.v_axis, fmt.v_channel_scaling, fmt.v_codec), *shape)
        return cls(k, v, block_size, dtype, t, gamma)

    @property
    def retained(self) -> int:
        """Retention slots a page (the block's share ``gamma``, rounded up)."""
        return math.ceil(self.gamma * self.block_size)

    @cached_property
    def regions(self) -> Regions:
        B, H, D, R = self.block_size, self.k.num_heads, self.k.head_size, self.retained
        return Regions([("k", self.k.nbytes), ("v", self.v.nbytes), ("norms", B * 2 * 2 * H * 2),
                        ("index", max(R, 1) * 2), ("kept", R * 2 * 2 * H * D * self.dtype.itemsize)])

    def dense_page_bytes(self) -> int:
        """What vLLM's own cache spends on the same block of both layers."""
        return 2 * 2 * self.block_size * self.k.num_heads * self.k.head_size * self.dtype.itemsize

    def encode(self, ka, va, kb, vb, num_valid: torch.Tensor) -> torch.Tensor:
        """Both layers' K and V [N, B, H, D] -> pages [N, page_bytes]; ``num_valid[n]`` leading tokens hold."""
        N, B, H, D = ka.shape
        x = torch.stack([torch.stack([ka, va], 2), torch.stack([kb, vb], 2)], 2).float()  # [N, B, 2, 2, H, D]
        valid = torch.arange(B, device=x.device)[None, :] < num_valid[:, None]
        x = torch.where(valid[:, :, None, None, None, None], x, 0)
        norms = x.norm(dim=-1, keepdim=True).to(torch.float16).float()
        unit = x / norms.clamp_min(_EPS)
        merged = slerp(unit[:, :, 0], unit[:, :, 1], self.t)  # [N, B, 2, H, D]
        distance = torch.arccos((unit[:, :, 0] * unit[:, :, 1]).sum(-1).clamp(-1.0, 1.0)).mean(dim=(2, 3))
        pages = torch.zeros(N, self.page_bytes, dtype=torch.uint8, device=x.device)
        r = self.regions
        r.write(pages, "k", self.k.encode(merged[:, :, 0], num_valid))
        r.write(pages, "v", self.v.encode(merged[:, :, 1], num_valid))
        r.write(pages, "norms", norms[..., 0].to(torch.float16))
        index = torch.full((N, max(self.retained, 1)), -1, dtype=torch.int16, device=x.device)
        if self.retained:
            top = torch.where(valid, distance, -1.0).topk(self.retained, dim=1)
            chosen = torch.where(top.values >= 0, top.indices, -1)
            index[:, :self.retained] = chosen.to(torch.int16)
            kept = x.gather(1, chosen.clamp_min(0)[:, :, None, None, None, None].expand(N, self.retained, 2, 2, H, D))
            r.write(pages, "kept", kept.to(self.dtype))
        r.write(pages, "index", index)
        return pages

    def decode(self, pages: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s (0: the pair's first) K and V [N, B, H, D], float32."""
        N, B, H, D, R = pages.shape[0], self.block_size, self.k.num_heads, self.k.head_size, self.retained
        r = self.regions
        start = r.start
        k = self.k.decode(pages[:, start("k"):start("k") + self.k.nbytes])
        v = self.v.decode(pages[:, start("v"):start("v") + self.v.nbytes])
        norms = r.view(pages, "norms", torch.float16, (B, 2, 2, H, 1)).float()[:, :, layer]  # [N, B, 2, H, 1]
        x = torch.stack([k, v], 2)
        x = x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS) * norms
        if R:
            index = r.view(pages, "index", torch.int16, (max(R, 1),))[:, :R].long()
            kept = r.view(pages, "kept", self.dtype, (R, 2, 2, H, D)).float()[:, :, layer]  # [N, R, 2, H, D]
            held = index >= 0
            pages_of = torch.arange(N, device=pages.device)[:, None].expand(N, R)
            x[pages_of[held], index[held]] = kept[held]
        return x[:, :, 0], x[:, :, 1]
