"""Decode rows over MiniCache's pages (``formats.merged``) for one layer of a pair.

The layer decode kernel (``decode.paged_decode`` over a ``MergedLayer``) reads the history: the
merged directions where a layer page keeps its codes, each token's logit and probability scaled by
the layer's norms, the retained tokens (norms stored negated) left out of their tiles and attended
exactly from their slots after the tiles, a block at a time. What the pages do not hold yet, a
decode row's own new token (the pair's pages take the step's tokens after both layers' attention),
is attended first (``own_token``); the decode kernel continues from its output and
log-sum-exp (``prior_lse``).
"""

from __future__ import annotations

import torch

from vllm_kvcompress.formats.merged import MergedLayer, MergedPairFormat

from .decode import paged_decode
from .decode import warm_up as warm_up_layer
from .own_token import own_token


def decode_rows(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor, fmt: MergedPairFormat,
                layer: int, block_table: torch.Tensor, history: torch.Tensor, scale: float, longest: int,
                out: torch.Tensor, row_order: torch.Tensor | None = None) -> None:
    """Decode rows (one new token each, ``q`` [N, Hq, D], ``key``/``value`` [N, H, D]) as
    ``paged_torch.attend_pair`` computes them: the ``history`` tokens before the new one (at most
    ``longest``) from the pages, the new token's own exact term beside them. ``q``, ``key``,
    ``value`` and ``out``: heads and channels contiguous within a row."""
    n, hq, d = q.shape
    if n == 0:
        return
    lse = own_token(q, key, value, scale, out)
    paged_decode(q, pages, MergedLayer(fmt, layer), block_table, history, scale, longest, out=out,
                 row_order=row_order, prior_lse=lse)


def warm_up(cache: torch.Tensor, fmt: MergedPairFormat, num_query_heads: int, query_dtype: torch.dtype) -> None:
    """Compile what a serving step may launch for both layers of ``fmt``'s pairs: the layer decode
    kernel's variants (``decode.warm_up``) and the own-token kernel. Launches one row over page 0;
    outputs are discarded."""
    heads, d = fmt.k.num_heads, fmt.k.head_size
    q = torch.zeros(1, num_query_heads, d, dtype=query_dtype, device=cache.device)
    new = torch.zeros(1, heads, d, dtype=query_dtype, device=cache.device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=cache.device)
    for layer in (0, 1):
        warm_up_layer(cache, MergedLayer(fmt, layer), num_query_heads, query_dtype)
        decode_rows(q, new, new, cache, fmt, layer, table, torch.zeros(1, dtype=torch.int32, device=cache.device),
                    1.0, 1, torch.empty_like(q))
