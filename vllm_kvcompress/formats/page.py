"""A KV page: the bytes one layer keeps for one block of tokens.

The page is K's codec region followed by V's, padded so that vLLM can see it as
``block_size`` equal token slots (``slot_bytes`` each). ``encode``/``decode``
work on whole blocks; the backend gathers and scatters pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codecs import UncompressedCodec, MinMaxCodec


def make_codec(bits: int, axis: str, channel_scaling: bool, dtype: torch.dtype,
               block_size: int, num_heads: int, head_size: int):
    if bits == 16:
        return UncompressedCodec(dtype, block_size, num_heads, head_size)
    return MinMaxCodec(bits, axis, channel_scaling, block_size, num_heads, head_size)


@dataclass(frozen=True)
class KVPageFormat:
    k: UncompressedCodec | MinMaxCodec
    v: UncompressedCodec | MinMaxCodec
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_layer_format(cls, fmt, dtype: torch.dtype, block_size: int, num_kv_heads: int,
                          head_size: int) -> "KVPageFormat":
        k = make_codec(fmt.k_bits, fmt.k_axis, False, dtype, block_size, num_kv_heads, head_size)
        v = make_codec(fmt.v_bits, fmt.v_axis, fmt.v_channel_scaling, dtype, block_size, num_kv_heads, head_size)
        return cls(k, v, block_size, dtype)

    @property
    def slot_bytes(self) -> int:
        """Bytes per token slot as vLLM sees it (page rounded up to whole slots of the dtype)."""
        elem = self.dtype.itemsize
        per_slot = -(-(self.k.nbytes + self.v.nbytes) // self.block_size)
        return -(-per_slot // elem) * elem

    @property
    def page_bytes(self) -> int:
        return self.slot_bytes * self.block_size

    def dense_page_bytes(self) -> int:
        """What vLLM's own uncompressed cache spends on the same block."""
        elem = self.dtype.itemsize
        return 2 * self.block_size * self.k.num_heads * self.k.head_size * elem

    def encode(self, k: torch.Tensor, v: torch.Tensor, num_valid: torch.Tensor) -> torch.Tensor:
        """k, v: [N, B, H, D] -> pages [N, page_bytes] uint8."""
        pages = torch.zeros(k.shape[0], self.page_bytes, dtype=torch.uint8, device=k.device)
        pages[:, :self.k.nbytes] = self.k.encode(k, num_valid)
        pages[:, self.k.nbytes:self.k.nbytes + self.v.nbytes] = self.v.encode(v, num_valid)
        return pages

    def decode(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pages [N, page_bytes] -> k, v float32 [N, B, H, D]."""
        k = self.k.decode(pages[:, :self.k.nbytes])
        v = self.v.decode(pages[:, self.k.nbytes:self.k.nbytes + self.v.nbytes])
        return k, v
