"""A KV page: the bytes one layer keeps for one block of tokens.

The page is K's codec region followed by V's (none for K-only pages), then, with outlier tokens,
their offsets [H, count] int16 and values [count, K heads then V heads, D] in the model dtype
(``outliers``), or, with a recent window (KVmix's RPC), 16-bit copies of the page's newest
``window_cap`` tokens; padded
so that vLLM can see it as ``block_size`` equal token slots (``slot_bytes``
each). ``encode``/``decode`` work on whole blocks; the backend gathers and
scatters pages.

The copies sit in a ring: the token at offset ``o`` of a page goes to copy slot
``o % window_cap``, so each page holds its own last ``window_cap`` tokens. A
request's newest ``w <= window_cap`` tokens span at most its last two pages,
and each of those still holds them, so a window up to the cap is always there
to read; older tokens are read from the codes ("quantized when they leave the
window" costs no rewrite).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from . import outliers as outlier_tokens
from .codecs import Codec, TensorSpec, UncompressedCodec, make_codec
from .layout import REGION_ALIGN, slot_bytes


def codec_for(field: str, spec: TensorSpec, *shape) -> Codec:
    try:
        return make_codec(spec, *shape)
    except ValueError as err:
        raise ValueError(f"field '{field}': {err}") from None


@dataclass(frozen=True)
class KVPageFormat:
    k: Codec
    v: Codec | None  # None: K-only page (slim attention rebuilds V)
    block_size: int
    dtype: torch.dtype
    recent: UncompressedCodec | None = None  # ring of 16-bit copies: K's heads, then V's
    window_fraction: float = 0.0
    outliers: int = 0  # tokens a block and KV head keeps exact, outside the statistics (``outliers``)

    @classmethod
    def from_layer_format(cls, fmt, dtype: torch.dtype, block_size: int, num_kv_heads: int,
                          head_size: int) -> "KVPageFormat":
        shape = (dtype, block_size, num_kv_heads, head_size)
        k = codec_for("k_codec", TensorSpec(fmt.k_bits, fmt.k_axis, codec=fmt.k_codec), *shape)
        v = None if fmt.k_only else codec_for("v_codec", TensorSpec(fmt.v_bits, fmt.v_axis, fmt.v_channel_scaling,
                                                                 fmt.v_codec), *shape)
        if not fmt.has_recent_window:
            if fmt.outlier_tokens >= block_size:
                raise ValueError(f"outlier_tokens = {fmt.outlier_tokens} must be below the block size "
                                 f"({block_size} tokens)")
            return cls(k, v, block_size, dtype, outliers=fmt.outlier_tokens)
        if fmt.rpc_tokens >= block_size:
            raise ValueError(f"rpc_tokens = {fmt.rpc_tokens} must be below the block size ({block_size} tokens)")
        recent = UncompressedCodec(dtype, fmt.rpc_tokens, 2 * num_kv_heads, head_size)
        return cls(k, v, block_size, dtype, recent, fmt.rpc_fraction)

    def __hash__(self) -> int:  # kept: formats key the kernels' caches at every launch
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.k, self.v, self.block_size, self.dtype, self.recent, self.window_fraction, self.outliers))

    def __getstate__(self) -> dict:
        """Without the kept hash and sizes: a hash holds only in the process that computed it."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @property
    def window_cap(self) -> int:
        return 0 if self.recent is None else self.recent.block_size

    def window(self, num_tokens: int) -> int:
        """How many of a context's newest tokens are read at 16 bits."""
        return min(self.window_cap, math.ceil(self.window_fraction * num_tokens - 1e-9))

    @property
    def codes_bytes(self) -> int:
        return self.k.nbytes + (0 if self.v is None else self.v.nbytes)

    @property
    def outlier_values_at(self) -> int:
        """Byte offset of the outliers' values (their offsets [H, count] int16 start at ``codes_bytes``)."""
        index_bytes = self.k.num_heads * self.outliers * 2
        return self.codes_bytes + -(-index_bytes // REGION_ALIGN) * REGION_ALIGN

    @property
    def outlier_bytes(self) -> int:
        if not self.outliers:
            return 0
        values = self.outliers * 2 * self.k.num_heads * self.k.head_size * self.dtype.itemsize
        return self.outlier_values_at - self.codes_bytes + values

    @cached_property  # read by every kernel launch
    def slot_bytes(self) -> int:
        """Bytes per token slot as vLLM sees it (page rounded up to whole slots of the dtype)."""
        recent = 0 if self.recent is None else self.recent.nbytes
        return slot_bytes(self.codes_bytes + self.outlier_bytes + recent, self.block_size, self.dtype)

    @cached_property
    def page_bytes(self) -> int:
        return self.slot_bytes * self.block_size

    def dense_page_bytes(self) -> int:
        """What vLLM's own uncompressed cache spends on the same block."""
        elem = self.dtype.itemsize
        return 2 * self.block_size * self.k.num_heads * self.k.head_size * elem

    def encode(self, k: torch.Tensor, v: torch.Tensor | None, num_valid: torch.Tensor,
               stored: torch.Tensor | None = None, num_stored: torch.Tensor | None = None) -> torch.Tensor:
        """k, v: [N, B, H, D] -> pages [N, page_bytes] uint8 (``v`` is ignored for K-only pages).
        ``stored``/``num_stored``: the pages before an append and how many tokens they held (see
        ``MinMaxCodec.encode``)."""
        pages = torch.zeros(k.shape[0], self.page_bytes, dtype=torch.uint8, device=k.device)
        k_stored = v_stored = None
        if stored is not None:
            k_stored, v_stored = stored[:, :self.k.nbytes], stored[:, self.k.nbytes:self.codes_bytes]
        if self.outliers:
            index = self._outlier_index(k, num_valid, stored, num_stored)
            self._write_outliers(pages, index, k, v)
            k, v = self._codec_rows(k, v, index, k_stored, v_stored, num_stored)
        pages[:, :self.k.nbytes] = self.k.encode(k, num_valid, k_stored, num_stored)
        if self.v is not None:
            pages[:, self.k.nbytes:self.codes_bytes] = self.v.encode(v, num_valid, v_stored, num_stored)
        return pages

    def outlier_index(self, pages: torch.Tensor) -> torch.Tensor:
        """[N, H, count] int64: the offsets of each block's outlier tokens by head (``outliers.NONE``: unused)."""
        H = self.k.num_heads
        raw = pages[:, self.codes_bytes:self.codes_bytes + H * self.outliers * 2].contiguous()
        return raw.view(torch.int16).reshape(-1, H, self.outliers).long()

    def _outlier_values(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [N, count, H, D] float32 of the outlier slots."""
        H, D, at = self.k.num_heads, self.k.head_size, self.outlier_values_at
        raw = pages[:, at:at + self.outliers * 2 * H * D * self.dtype.itemsize].contiguous()
        kv = raw.view(self.dtype).reshape(-1, self.outliers, 2 * H, D).float()
        return kv[:, :, :H], kv[:, :, H:]

    def _outlier_index(self, k, num_valid, stored, num_stored) -> torch.Tensor:
        """A block's first write chooses its outliers; an append keeps the stored ones."""
        chosen = outlier_tokens.choose(k, num_valid, self.outliers)
        if stored is None:
            return chosen
        return torch.where((num_stored == 0)[:, None, None], chosen, self.outlier_index(stored))

    def _write_outliers(self, pages: torch.Tensor, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        H, D, at = self.k.num_heads, self.k.head_size, self.outlier_values_at
        pages[:, self.codes_bytes:self.codes_bytes + H * self.outliers * 2] = \
            index.to(torch.int16).flatten(1).contiguous().view(torch.uint8)
        kv = torch.cat([outlier_tokens.gather(k, index), outlier_tokens.gather(v, index)], dim=2).to(self.dtype)
        pages[:, at:at + kv[0].numel() * self.dtype.itemsize] = kv.contiguous().view(torch.uint8).reshape(
            pages.shape[0], -1)

    def _codec_rows(self, k, v, index, k_stored, v_stored, num_stored):
        """What the codecs code: an outlier's row repeats another token's in a block's first write
        (``outliers.fill_rows``) and its stored codes' values in an append, so that its codes never
        enter a grid (a kernel that appends requantizes stored codes, not the exact values)."""
        k_in, v_in = outlier_tokens.fill_rows(k, index), outlier_tokens.fill_rows(v, index)
        if k_stored is None:
            return k_in, v_in
        appended = (num_stored > 0)[:, None, None, None]
        is_outlier = outlier_tokens.outlier_rows(index, self.block_size)[..., None] & appended
        k_in = torch.where(is_outlier, self.k.decode(k_stored), k_in)
        v_in = torch.where(is_outlier, self.v.decode(v_stored), v_in)
        return k_in, v_in

    def decode(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """pages [N, page_bytes] -> k, v float32 [N, B, H, D] (v None for K-only pages)."""
        k = self.k.decode(pages[:, :self.k.nbytes])
        v = None if self.v is None else self.v.decode(pages[:, self.k.nbytes:self.codes_bytes])
        if self.outliers:
            index = self.outlier_index(pages)
            exact_k, exact_v = self._outlier_values(pages)
            k, v = outlier_tokens.scatter(k, index, exact_k), outlier_tokens.scatter(v, index, exact_v)
        return k, v

    def decode_recent(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pages -> the ring's k, v float32 [N, window_cap, H, D]; slot s holds offset o with o % cap == s."""
        kv = self.recent.decode(pages[:, self.codes_bytes:self.codes_bytes + self.recent.nbytes])
        return kv.chunk(2, dim=2)

    def write_recent(self, pages: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """Copy tokens ``k``/``v`` [M, H, D] at block ``offsets`` of ``pages[rows]`` into their ring slots."""
        region = slice(self.codes_bytes, self.codes_bytes + self.recent.nbytes)
        ring = self.recent.decode(pages[:, region])
        ring[rows, offsets % self.window_cap] = torch.cat([k, v], dim=1).float()
        full = torch.full((pages.shape[0],), self.window_cap, device=pages.device)
        pages[:, region] = self.recent.encode(ring, full)
