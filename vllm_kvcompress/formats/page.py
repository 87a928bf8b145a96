"""A KV page: the bytes one layer keeps for one block of tokens.

The page is K's codec region followed by V's (none for K-only pages), then, with outlier tokens,
their offsets [H, count] int16, codes and statistics (``outliers``), or, with a recent window
(KVmix's RPC), 16-bit copies of the page's newest ``window_cap`` tokens; padded
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
from .layout import Regions, slot_bytes


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
        k = codec_for("k_codec", TensorSpec(fmt.k_bits, fmt.k_axis, codec=fmt.k_codec, clip=fmt.k_clip), *shape)
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

    @cached_property
    def outlier_regions(self) -> Regions:
        """The outliers' offsets [H, count] int16, K codes [count, H, D * K_BITS / 8], V codes
        [count, H, D * V_BITS / 8] and each row's float16 (zero, scale) [count, 2 H (K's heads, then
        V's), 2], from ``codes_bytes`` on."""
        H, D, n = self.k.num_heads, self.k.head_size, self.outliers
        return Regions([("index", H * n * 2), ("k_codes", n * H * D * outlier_tokens.K_BITS // 8),
                        ("v_codes", n * H * D * outlier_tokens.V_BITS // 8), ("stats", n * 2 * H * 2 * 2)])

    def outlier_at(self, region: str) -> int:
        """Byte offset in the page of an outlier region (``outlier_regions``)."""
        return self.codes_bytes + self.outlier_regions.start(region)

    @property
    def outlier_bytes(self) -> int:
        return self.outlier_regions.nbytes if self.outliers else 0

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
            k = outlier_tokens.fill_rows(k, index)  # out of K's statistics (their codes are never read)
        pages[:, :self.k.nbytes] = self.k.encode(k, num_valid, k_stored, num_stored)
        if self.v is not None:
            pages[:, self.k.nbytes:self.codes_bytes] = self.v.encode(v, num_valid, v_stored, num_stored)
        return pages

    def outlier_index(self, pages: torch.Tensor) -> torch.Tensor:
        """[N, H, count] int64: the offsets of each block's outlier tokens by head (``outliers.NONE``: unused)."""
        shape = (self.k.num_heads, self.outliers)
        return self.outlier_regions.view(pages[:, self.codes_bytes:], "index", torch.int16, shape).long()

    def _outlier_values(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [N, count, H, D] float32 of the outlier slots."""
        H, D, n = self.k.num_heads, self.k.head_size, self.outliers
        region, regions = pages[:, self.codes_bytes:], self.outlier_regions
        stats = regions.view(region, "stats", torch.float16, (n, 2 * H, 2))
        k_codes = regions.view(region, "k_codes", torch.uint8, (n, H, D * outlier_tokens.K_BITS // 8))
        v_codes = regions.view(region, "v_codes", torch.uint8, (n, H, D * outlier_tokens.V_BITS // 8))
        return (outlier_tokens.dequantize_rows(k_codes, stats[:, :, :H], outlier_tokens.K_BITS, D),
                outlier_tokens.dequantize_rows(v_codes, stats[:, :, H:], outlier_tokens.V_BITS, D))

    def _outlier_index(self, k, num_valid, stored, num_stored) -> torch.Tensor:
        """A block's first write chooses its outliers; an append keeps the stored ones."""
        if stored is None:
            return outlier_tokens.choose(k, num_valid, self.outliers)
        index = self.outlier_index(stored)
        fresh = num_stored == 0
        if fresh.any():
            index[fresh] = outlier_tokens.choose(k[fresh], num_valid[fresh], self.outliers)
        return index

    def _write_outliers(self, pages: torch.Tensor, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        region = pages[:, self.codes_bytes:]
        self.outlier_regions.write(region, "index", index.to(torch.int16).flatten(1))  # flat: viewable as bytes
        k_codes, k_stats = outlier_tokens.quantize_rows(outlier_tokens.gather(k, index), outlier_tokens.K_BITS)
        v_codes, v_stats = outlier_tokens.quantize_rows(outlier_tokens.gather(v, index), outlier_tokens.V_BITS)
        self.outlier_regions.write(region, "k_codes", k_codes)
        self.outlier_regions.write(region, "v_codes", v_codes)
        self.outlier_regions.write(region, "stats", torch.cat([k_stats, v_stats], dim=2))

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
