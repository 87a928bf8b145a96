"""Decode rows over ZipCache's pages (``formats.salient``), before their new tokens are written.

The decode kernel (``decode.paged_decode`` over a ``SalientTokensFormat``, SALIENT) reads the
history: every token's high plane, and a refined token's low bits through its block's slot map, in
the products of the 2-bit pages' loop. A decode row's own new token, which the pages take only after
attention (the write chooses with the probabilities it receives), is attended first
(``own_token``); the kernel continues from it and leaves the merged log-sum-exp, from which the
write (``salient_write.write_decoded``) turns the row's logits over its last block into its probe's
probabilities: no second pass over the context.
"""

from __future__ import annotations

import torch

from vllm_kvcompress.formats.salient import SalientTokensFormat

from . import salient_write
from .decode import paged_decode
from .decode import warm_up as warm_up_layer
from .own_token import own_token


def decode_rows(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pages: torch.Tensor,
                fmt: SalientTokensFormat, block_table: torch.Tensor, history: torch.Tensor, scale: float,
                longest: int, out: torch.Tensor, row_order: torch.Tensor | None = None, **tuning) -> torch.Tensor:
    """Decode rows (one new token each, ``q`` [N, Hq, D], ``key``/``value`` [N, H, D]) over the
    ``history`` tokens before the new one (at most ``longest``) from the pages and the new token
    exact, into ``out``; returns each row's natural log-sum-exp [Hq, N]. ``tuning``: the decode
    kernel's split count, tile, warps and stages where not its defaults (tests, benchmarks), and a
    sliding-window layer's ``window`` and ``first_keys`` (each row's context less the window)."""
    lse = own_token(q, key, value, scale, out)
    paged_decode(q, pages, fmt, block_table, history, scale, longest, out=out, row_order=row_order, prior_lse=lse,
                 lse_out=True, **tuning)
    return lse


def warm_up(cache: torch.Tensor, fmt: SalientTokensFormat, num_query_heads: int, query_dtype: torch.dtype,
            window: int | None = None) -> None:
    """Compile what a serving step may launch over ``fmt``'s pages: the decode kernel's variants,
    every row continuing a prior and leaving the merged log-sum-exp (``decode.warm_up``), the
    own-token kernel, and every kind of write (``salient_write.warm_up``). Launches over page 0;
    outputs are discarded."""
    warm_up_layer(cache, fmt, num_query_heads, query_dtype, window, lse_out=True)
    q = torch.zeros(1, num_query_heads, fmt.k.head_size, dtype=query_dtype, device=cache.device)
    new = torch.zeros(1, fmt.k.num_heads, fmt.k.head_size, dtype=query_dtype, device=cache.device)
    own_token(q, new, new, 1.0, torch.empty_like(q))
    salient_write.warm_up(cache, fmt, num_query_heads, query_dtype)
