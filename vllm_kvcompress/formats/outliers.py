"""Outlier tokens: a few tokens of each block and KV head kept apart, outside the block's statistics.

K's statistics per channel span a block's tokens, so one token far from the others (the attention
sink, whose K sits apart in many channels) stretches every channel's grid and costs the block's
other tokens their resolution; at 2 and 3 bits that is most of the loss (docs/formats.md, "Outlier
tokens"). A page keeps the ``count`` tokens of a block's first write whose K lies furthest from that
write's others (``deviation``) in their own slots, and leaves them out of K's statistics (the torch
reference codes their K rows as another token's, ``fill_rows``; their codes are never read):
attention reads them from their slots. A slot codes each row (one token, one head, K or V) on its
own min-max grid, float16 zero and scale as the codecs': K on ``K_BITS`` bits, V on ``V_BITS``
(``quantize_rows``). On SmolLM2's and Qwen2.5-Coder's prose at 2 bits this reads back the same
perplexity as 16-bit slots (docs/formats.md) in 40% of their bytes.

A block whose first write holds no more than ``count`` tokens (a decoding request's new block)
keeps none: there is nothing to compare against. Later writes append under the codec's rule and
leave the outliers as they are.
"""

from __future__ import annotations

import torch

from .codecs import min_max_codes, min_max_grid
from .packing import pack, unpack

NONE = -1  # an unused outlier slot's token index
DEVIATION_EPS = 1e-6  # added to a channel's standard deviation (a constant channel scores 0, not nan)
K_BITS, V_BITS = 8, 4  # an outlier row's codes: the sink's K spans far more than its V


def deviation(k: torch.Tensor, num_valid: torch.Tensor) -> torch.Tensor:
    """[N, B, H] float32: each valid token's largest z-score over K's channels against the block's
    valid tokens (mean and population standard deviation per head and channel); -inf past
    ``num_valid``."""
    B = k.shape[1]
    valid = (torch.arange(B, device=k.device)[None, :] < num_valid[:, None])[:, :, None, None]
    k = k.float()
    n = num_valid.clamp(min=1).float()[:, None, None, None]
    mean = torch.where(valid, k, 0).sum(1, keepdim=True) / n
    std = (torch.where(valid, (k - mean) ** 2, 0).sum(1, keepdim=True) / n).sqrt()
    score = ((k - mean).abs() / (std + DEVIATION_EPS)).amax(-1)
    return torch.where(valid[..., 0], score, float("-inf"))


def choose(k: torch.Tensor, num_valid: torch.Tensor, count: int) -> torch.Tensor:
    """[N, H, count] int64: per block and head, the offsets of the ``count`` most deviant tokens, most
    deviant first; ``NONE`` throughout for a block of no more than ``count`` tokens."""
    top = deviation(k, num_valid).topk(count, dim=1).indices.transpose(1, 2)  # [N, H, count]
    return torch.where((num_valid > count)[:, None, None], top, NONE)


def outlier_rows(index: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, B, H] bool: the token at that offset is one of its head's outliers."""
    rows = torch.arange(block_size, device=index.device)[None, :, None, None]
    return (rows == index[:, None, :, :]).any(-1)


def fill_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` [N, B, H, D] with each outlier's row replaced by its head's first other token's row (a
    block with outliers has one): the block's statistics are then the others' own."""
    is_outlier = outlier_rows(index, x.shape[1])
    first_other = (~is_outlier).to(torch.uint8).argmax(1)  # [N, H]
    fill = x.gather(1, first_other[:, None, :, None].expand(-1, 1, -1, x.shape[3]))
    return torch.where(is_outlier[..., None], fill, x)


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[N, count, H, D]: the outliers' rows of ``x`` [N, B, H, D] (zeros for ``NONE``)."""
    at = index.clamp(min=0).transpose(1, 2)[..., None].expand(-1, -1, -1, x.shape[3])  # [N, count, H, D]
    return torch.where((index >= 0).transpose(1, 2)[..., None], x.gather(1, at), 0)


def scatter(x: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``x`` [N, B, H, D] with the outliers' rows set to ``values`` [N, count, H, D]. Offsets outside
    the block (a page that held another request's tokens, about to be written anew) are ignored."""
    out = x.clone()
    N, count, H, _ = values.shape
    n = torch.arange(N, device=x.device)[:, None, None]
    h = torch.arange(H, device=x.device)[None, None, :]
    at = index.transpose(1, 2)  # [N, count, H]
    used = (at >= 0) & (at < x.shape[1])
    out[n.expand_as(at)[used], at[used], h.expand_as(at)[used]] = values[used].to(out.dtype)
    return out


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] -> packed codes [..., D * bits / 8] uint8 and float16 (zero, scale) [..., 2]:
    each row on its own min-max grid, as the codecs code."""
    x, top = x.float(), (1 << bits) - 1
    zero, scale = min_max_grid(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), top)
    return pack(min_max_codes(x, zero, scale, top), bits), torch.cat([zero, scale], -1).half()


def dequantize_rows(codes: torch.Tensor, stats: torch.Tensor, bits: int, head_size: int) -> torch.Tensor:
    """Inverse of ``quantize_rows``: float32 [..., head_size]."""
    stats = stats.float()
    return unpack(codes, bits, head_size).float() * stats[..., 1:] + stats[..., :1]
