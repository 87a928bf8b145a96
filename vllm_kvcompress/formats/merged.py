"""MiniCache: one page holds two adjacent layers' K and V as merged directions (a format over a
group of layers).

For each token and head, layer a's and layer b's vectors x_a, x_b are split into norms and unit
directions; the page keeps SLERP(u_a, u_b, t) once (through the layer format's codec, 16-bit or
quantized) and both layers' norms. Layer a is restored as the stored direction times its norm,
layer b likewise (a dequantized direction is not renormalized: a per-token factor folds into the
decode kernel's products, a per-token length would not; docs/formats.md). The block's tokens
whose two directions differ most (a share ``gamma`` of the block, by angular distance averaged
over heads and over K and V) keep both layers' vectors unmerged in fixed retention slots, with
their token offsets. The paper (Liu et al., 2024) merges per token over the whole vector and
retains over the whole context; choices made here for fixed pages are in docs/formats.md.

Page: K direction codes | V direction codes | norms [2 layers, 2 (K, V), H, B] float16 (a retained
token's negated) | retained token offsets [R] int16 (-1: empty) | their distances [R] float32 |
retained vectors [R, 2 layers, 2 (K, V), H, D] in the model dtype. The codes lie as a
``KVPageFormat`` page's (``directions``), so new tokens are appended under the same codecs' append
rule, by the same write kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from .codecs import Codec, TensorSpec
from .layout import Regions, SlottedPage
from .page import KVPageFormat, codec_for

NORM_EPS = 1e-6  # the least norm a direction is divided by
SLERP_NEAR = 1e-4  # below this sine of their angle, two directions are taken as one and mixed linearly


def slerp(u: torch.Tensor, w: torch.Tensor, t: float) -> torch.Tensor:
    """Spherical interpolation between unit vectors along the last axis (linear where they coincide)."""
    cos = (u * w).sum(-1, keepdim=True).clamp(-1.0, 1.0)
    omega = torch.arccos(cos)
    sin = torch.sin(omega)
    near = sin < SLERP_NEAR
    a = torch.where(near, 1.0 - t, torch.sin((1.0 - t) * omega) / sin.clamp_min(SLERP_NEAR))
    b = torch.where(near, t, torch.sin(t * omega) / sin.clamp_min(SLERP_NEAR))
    return a * u + b * w


def _marked(norms: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Norms [N, 2, 2, H, B] as stored: negated (sign bit set, also for a zero norm) at the retained
    tokens' offsets ``index`` [N, R] (-1: none), so that the decode kernel masks them where it reads
    the norms anyway; positive elsewhere."""
    N, B = norms.shape[0], norms.shape[-1]
    index = index.long()
    retained = torch.zeros(N, B + 1, dtype=torch.bool, device=norms.device)
    retained.scatter_(1, torch.where(index >= 0, index, B), True)
    return torch.where(retained[:, None, None, None, :B], -norms.abs(), norms.abs())


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
        if fmt.outlier_tokens:
            raise ValueError(f"outlier_tokens = {fmt.outlier_tokens} cannot be combined with 'merge' (merged pairs "
                             "keep their own retained tokens; allowed: 0)")
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
        return Regions([("k", self.k.nbytes), ("v", self.v.nbytes), ("norms", 2 * 2 * H * B * 2),
                        ("index", max(R, 1) * 2), ("distance", max(R, 1) * 4),
                        ("kept", R * 2 * 2 * H * D * self.dtype.itemsize)])

    @cached_property
    def directions(self) -> KVPageFormat:
        """The merged directions' codes as a layer page's: the pair page's first bytes are laid out
        as this format's K and V codes."""
        page = KVPageFormat(self.k, self.v, self.block_size, self.dtype)
        assert self.regions.start("v") == self.k.nbytes, "the pair page's codes must lie as a layer page's"
        return page

    def dense_page_bytes(self) -> int:
        """What vLLM's own cache spends on the same block of both layers."""
        return 2 * 2 * self.block_size * self.k.num_heads * self.k.head_size * self.dtype.itemsize

    def merge(self, ka, va, kb, vb) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Both layers' K and V [..., H, D] -> the vectors stacked [..., 2 layers, 2 (K, V), H, D]
        (in their dtype), the merged directions [..., 2 (K, V), H, D] in the model dtype (what the
        codecs take), the norms [..., 2 layers, 2, H] in float16 (as stored), and each token's
        distance [...]: the angle between the layers' directions, averaged over K, V and heads."""
        x = torch.stack([torch.stack([ka, va], -3), torch.stack([kb, vb], -3)], -4)
        norms = x.float().norm(dim=-1, keepdim=True).to(torch.float16)
        unit = x.float() / norms.float().clamp_min(NORM_EPS)
        ua, ub = unit.unbind(-4)
        merged = slerp(ua, ub, self.t).to(self.dtype)
        distance = torch.arccos((ua * ub).sum(-1).clamp(-1.0, 1.0)).mean(dim=(-2, -1))
        return x, merged, norms[..., 0], distance

    def encode(self, ka, va, kb, vb, num_valid: torch.Tensor) -> torch.Tensor:
        """Both layers' K and V [N, B, H, D] -> pages [N, page_bytes]; ``num_valid[n]`` leading tokens hold."""
        N, B, H, D = ka.shape
        valid = torch.arange(B, device=ka.device)[None, :] < num_valid[:, None]
        x, merged, norms, distance = self.merge(*(torch.where(valid[:, :, None, None], t, 0) for t in (ka, va, kb, vb)))
        pages = torch.zeros(N, self.page_bytes, dtype=torch.uint8, device=ka.device)
        r = self.regions
        k, v = merged.float().unbind(2)
        pages[:, :self.directions.codes_bytes] = self.directions.encode(k, v, num_valid)[:, :self.directions.codes_bytes]
        index = torch.full((N, max(self.retained, 1)), -1, dtype=torch.int16, device=ka.device)
        kept_distance = torch.full((N, max(self.retained, 1)), -1.0, device=ka.device)
        if self.retained:
            top = torch.where(valid, distance, -1.0).topk(self.retained, dim=1)
            chosen = torch.where(top.values >= 0, top.indices, -1)
            index[:, :self.retained] = chosen.to(torch.int16)
            kept_distance[:, :self.retained] = top.values
            kept = x.gather(1, chosen.clamp_min(0)[:, :, None, None, None, None].expand(N, self.retained, 2, 2, H, D))
            r.write(pages, "kept", kept.to(self.dtype))
        r.write(pages, "norms", _marked(norms.permute(0, 2, 3, 4, 1), index))  # [N, B, 2, 2, H] -> [N, 2, 2, H, B]
        r.write(pages, "index", index)
        r.write(pages, "distance", kept_distance)
        return pages

    def append(self, old: torch.Tensor, which: torch.Tensor, offsets: torch.Tensor, filled: torch.Tensor,
               num_stored: torch.Tensor, ka, va, kb, vb) -> torch.Tensor:
        """Pages ``old`` [N, page_bytes] with new tokens (both layers' K and V [M, H, D]) at ``offsets``
        of pages ``which`` [M]; ``num_stored``/``filled``: tokens each page held before and after.
        The merged directions go in under the codecs' append rule (``KVPageFormat.encode``), the
        norms beside them; a page's retention slots keep the most distinct of the tokens they held
        and the new ones (ties: the earlier token). Tokens already merged stay merged."""
        N, B, R = old.shape[0], self.block_size, self.retained
        H, D = self.k.num_heads, self.k.head_size
        x, merged, norms, distance = self.merge(ka, va, kb, vb)
        pages = old.clone()
        codes = self.directions
        k, v = codes.decode(old)
        k[which, offsets], v[which, offsets] = merged[:, 0].to(k.dtype), merged[:, 1].to(v.dtype)
        pages[:, :codes.codes_bytes] = codes.encode(k, v, filled, old, num_stored)[:, :codes.codes_bytes]
        r = self.regions
        stored_norms = r.view(old, "norms", torch.float16, (2, 2, H, B))
        stored_norms[which, :, :, :, offsets] = norms
        if not R:
            r.write(pages, "norms", stored_norms)
            return pages
        index = r.view(old, "index", torch.int16, (R,)).long()
        index = torch.where(index < num_stored[:, None], index, -1)  # a reused page's slots hold nothing yet
        new_distance = torch.full((N, B), -1.0, device=old.device)
        new_distance[which, offsets] = distance
        candidates = torch.cat([torch.where(index >= 0, r.view(old, "distance", torch.float32, (R,)), -1.0),
                                new_distance], 1)  # [N, R + B]: the held tokens, then each offset's new one
        at = torch.cat([index, torch.arange(B, device=old.device).expand(N, B)], 1)
        by_offset = torch.sort(at, dim=1, stable=True).indices  # ties go to the earlier token
        order = torch.sort(candidates.gather(1, by_offset), dim=1, descending=True, stable=True).indices
        ranked = by_offset.gather(1, order)[:, :R]
        held = candidates.gather(1, ranked) >= 0
        new_x = torch.zeros(N, B, 2, 2, H, D, device=old.device)
        new_x[which, offsets] = x.float()
        pool = torch.cat([r.view(old, "kept", self.dtype, (R, 2, 2, H, D)).float(), new_x], 1)
        kept = pool.gather(1, ranked[:, :, None, None, None, None].expand(N, R, 2, 2, H, D))
        index = torch.where(held, at.gather(1, ranked), -1)
        r.write(pages, "norms", _marked(stored_norms, index))
        r.write(pages, "index", index.to(torch.int16))
        r.write(pages, "distance", torch.where(held, candidates.gather(1, ranked), -1.0))
        r.write(pages, "kept", torch.where(held[:, :, None, None, None, None], kept, 0).to(self.dtype))
        return pages

    def decode(self, pages: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s (0: the pair's first) K and V [N, B, H, D], float32."""
        N, B, H, D, R = pages.shape[0], self.block_size, self.k.num_heads, self.k.head_size, self.retained
        r = self.regions
        k, v = self.directions.decode(pages)
        norms = r.view(pages, "norms", torch.float16, (2, 2, H, B)).float()[:, layer].abs()  # [N, 2, H, B]
        x = torch.stack([k, v], 2) * norms.permute(0, 3, 1, 2)[..., None]
        if R:
            index = r.view(pages, "index", torch.int16, (max(R, 1),))[:, :R].long()
            kept = r.view(pages, "kept", self.dtype, (R, 2, 2, H, D)).float()[:, :, layer]  # [N, R, 2, H, D]
            held = index >= 0
            pages_of = torch.arange(N, device=pages.device)[:, None].expand(N, R)
            x[pages_of[held], index[held]] = kept[held]
        return x[:, :, 0], x[:, :, 1]


@dataclass(frozen=True)
class MergedLayer:
    """Layer ``layer`` (0: the first) of a pair's pages as the layer decode kernel reads them: the
    direction codes where a layer page keeps its codes, each token's K and V scaled by this layer's
    norms; the retained tokens (norms stored negated) from their slots, exact."""
    pair: MergedPairFormat
    layer: int

    @property
    def k(self) -> Codec:
        return self.pair.k

    @property
    def v(self) -> Codec:
        return self.pair.v

    @property
    def block_size(self) -> int:
        return self.pair.block_size

    @property
    def page_bytes(self) -> int:
        return self.pair.page_bytes

    def norms_at(self, kv: int) -> int:
        """Byte offset of this layer's K (``kv`` 0) or V (1) norms, [H, B] float16."""
        return self.pair.regions.start("norms") + (self.layer * 2 + kv) * self.k.num_heads * self.block_size * 2
