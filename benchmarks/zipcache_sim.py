"""ZipCache's choice of salient tokens simulated on the Hugging Face model: per block, as the pages
hold it, or over the whole context, as the paper ranks (its global top r), on the same windows and
chunks as the engine's rows.

Each cached token's K and V are fake-quantized as ``formats.salient`` stores them: a 4-bit min-max
grid (K per channel over each block of ``block`` tokens, V per token), a salient token at its 4-bit
code and another at the middle of its 2-bit level. At every chunk, probe queries (the newest 5% and
5% of the others at random, ``salient_torch.probe_rows``) score the cached and new tokens by
normalized attention; of the tokens that still have 4 bits and the chunk's own, the best
``ceil(r n)`` keep them, per block of ``n`` tokens (``-block``) or over the context (``-global``). A
decoded token is held at 4 bits until the context reaches a multiple of the re-compression
interval, as in the engine. Full-attention layers only (no sliding windows).

``-halves`` and ``-halves-plain`` keep the per-block choice but give each precision its own grid,
as split-row pages whose halves are a 4/4 and a 2/2 page of their own tokens would: K's 4-bit grid
per channel over the block's salient tokens, the others' over theirs, read at the middle of their
2-bit levels (``-halves``) or on a plain 2-bit min-max grid (``-halves-plain``, V's too).

Setting names: ``zipsim-rPERCENT-block|global|halves|halves-plain``, e.g. ``zipsim-r60-global``.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

import torch

from vllm_kvcompress.config import SalientSpec
from vllm_kvcompress.formats.codecs import min_max_codes, min_max_grid
from vllm_kvcompress.formats.salient import MIDDLE, SalientTokensFormat
from vllm_kvcompress.salient_torch import probe_rows

_NAME = re.compile(r"zipsim-r(?P<ratio>\d+)-(?P<rule>block|global|halves|halves-plain)")


def _middle(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes read at the middle of their 2-bit level (a 2-bit token's, ``salient.MIDDLE``)."""
    return torch.div(codes, 4, rounding_mode="floor") * 4 + MIDDLE


def _nested(x: torch.Tensor, dim: int, salient: torch.Tensor) -> torch.Tensor:
    """x [H, n, d] on a 4-bit min-max grid with statistics over ``dim``: salient [H, n] tokens at their
    code, the others at the middle of their 2-bit level (the pages' grid rule, ``min_max_grid``)."""
    zero, scale = min_max_grid(x.amin(dim, keepdim=True), x.amax(dim, keepdim=True), 15.0)
    codes = min_max_codes(x, zero, scale, 15.0)
    return torch.where(salient[..., None], codes, _middle(codes)) * scale + zero


def _halves(x: torch.Tensor, dim: int, salient: torch.Tensor, plain: bool) -> torch.Tensor:
    """x [H, n, d] with each precision on a grid of its own tokens (``dim`` 1: per channel, K; 2: per
    token, V): salient at 4 bits, the others at the middle of a 4-bit grid's 2-bit levels over their
    own values, or (``plain``) on a 2-bit grid; the pages' grid rule (``min_max_grid``)."""
    out = []
    for mask, high in ((salient, True), (~salient, False)):
        top = 3.0 if (plain and not high) else 15.0
        m = mask[..., None].expand_as(x)
        lo = torch.where(m, x, float("inf")).amin(dim, keepdim=True)
        hi = torch.where(m, x, float("-inf")).amax(dim, keepdim=True)
        zero, scale = min_max_grid(torch.where(torch.isfinite(lo), lo, 0.0), torch.where(torch.isfinite(hi), hi, 0.0),
                                   top)
        codes = min_max_codes(x, zero, scale, top)
        if not high and not plain:
            codes = _middle(codes)
        out.append(codes * scale + zero)
    return torch.where(salient[..., None], out[0], out[1])


@dataclass
class ZipSimSpec:
    ratio: float
    rule: str  # "block" or "global"
    block: int = 128
    probes: SalientSpec = SalientSpec()
    salient: dict[int, torch.Tensor] = field(default_factory=dict)  # by layer: [H, cached tokens] bool

    @classmethod
    def parse(cls, name: str) -> "ZipSimSpec | None":
        m = _NAME.fullmatch(name)
        if m is None:
            return None
        ratio = int(m["ratio"]) / 100
        if not 0 < ratio <= 1:
            raise SystemExit(f"setting {name!r}: the share of 4-bit tokens must be 1..100 percent")
        return cls(ratio, m["rule"])

    def kv_vs_16bit(self, head_size: int, context: int) -> float:
        """The pages' arithmetic (both rules keep the same share of 4-bit tokens)."""
        fmt = SalientTokensFormat.create(self.ratio, torch.bfloat16, self.block, 1, head_size)
        return fmt.dense_page_bytes() / fmt.page_bytes

    def _fake_quantized(self, k: torch.Tensor, v: torch.Tensor, salient: torch.Tensor):
        """k, v [H, n, d] of cached tokens through the pages' two precisions, block by block."""
        quantize = (functools.partial(_halves, plain=self.rule == "halves-plain") if self.rule.startswith("halves")
                    else _nested)
        parts = [(quantize(k[:, a:a + self.block], 1, salient[:, a:a + self.block]),
                  quantize(v[:, a:a + self.block], 2, salient[:, a:a + self.block]))
                 for a in range(0, k.shape[1], self.block)]
        return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)

    def cached(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float):
        """The keys and values a chunk's attention reads (batch 1): cached ones at their precision, its
        own exact; then the choice of 4-bit tokens with the chunk's own added."""
        m, L = query.shape[2], key.shape[2]
        n = L - m
        k, v = key[0].float(), value[0].float()
        heads = k.shape[0]
        salient = self.salient.get(module.layer_idx) if n else None
        if n:
            k_hist, v_hist = self._fake_quantized(k[:, :n], v[:, :n], salient)
            k, v = torch.cat([k_hist, k[:, n:]], 1), torch.cat([v_hist, v[:, n:]], 1)
        else:
            salient = torch.zeros(heads, 0, dtype=torch.bool)
        candidates = torch.cat([salient, torch.ones(heads, m, dtype=torch.bool)], 1)
        if m == 1 and L % self.probes.recompress_interval:
            self.salient[module.layer_idx] = candidates  # held at 4 bits until the next re-compression
        else:
            self.salient[module.layer_idx] = self._choose(query[0].float(), k, n, candidates, scale)
        return k[None].to(key.dtype), v[None].to(value.dtype)

    def _choose(self, q: torch.Tensor, k: torch.Tensor, n: int, candidates: torch.Tensor, scale: float):
        m, L = q.shape[1], k.shape[1]
        rows = probe_rows(m, L, self.probes)
        group = q.shape[0] // k.shape[0]
        pos = torch.arange(n, L)[rows]
        sees = torch.arange(L)[None, :] <= pos[:, None]
        logits = q[:, rows] @ k.repeat_interleave(group, 0).transpose(1, 2) * scale
        probs = logits.masked_fill(~sees, float("-inf")).softmax(-1)
        score = probs.unflatten(0, (k.shape[0], group)).sum((1, 2)) / sees.sum(0)  # [H, L]
        score = torch.where(candidates, score, float("-inf"))
        keep = torch.zeros_like(candidates)
        spans = [(0, L)] if self.rule == "global" else [(a, min(a + self.block, L)) for a in range(0, L, self.block)]
        for a, b in spans:
            top = score[:, a:b].topk(math.ceil(self.ratio * (b - a) - 1e-9), dim=1).indices
            keep[:, a:b].scatter_(1, top, True)
        return keep & candidates
