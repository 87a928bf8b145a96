"""Bit packing of integer codes along the last axis.

2, 4 and 8 bits pack densely into bytes, code ``i`` of a row at bits
``(i % (8 // bits)) * bits`` of byte ``i // (8 // bits)``. 3 bits are two
planes, each packed that way: the codes' low two bits as a 2-bit row, then
their high bit as a 1-bit row (``3 * D / 8`` bytes a row). The decode kernels
unpack both planes with the masks of 2-bit codes (docs/formats.md).
"""

from __future__ import annotations

import torch

PACKED_BITS = (2, 3, 4, 8)


def packed_row_bytes(num_values: int, bits: int) -> int:
    """Bytes taken by one packed row of ``num_values`` codes."""
    if bits not in PACKED_BITS:
        raise ValueError(f"bits must be one of {PACKED_BITS}, got {bits}")
    return num_values * bits // 8


def _pack_dense(c: torch.Tensor, bits: int) -> torch.Tensor:
    n = c.shape[-1]
    per_byte = 8 // bits
    if n % per_byte:
        raise ValueError(f"row length {n} is not a multiple of {per_byte} for {bits}-bit packing")
    c = c.reshape(*c.shape[:-1], n // per_byte, per_byte)
    shifts = torch.arange(per_byte, device=c.device) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def _unpack_dense(p: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=p.device, dtype=torch.int32) * bits
    return ((p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*p.shape[:-1], p.shape[-1] * per_byte)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (any int dtype, values < 2**bits) into uint8 rows."""
    c = codes.to(torch.int64)
    if bits == 8:
        return c.to(torch.uint8)
    if bits in (2, 4):
        return _pack_dense(c, bits)
    if bits == 3:
        return torch.cat([_pack_dense(c & 3, 2), _pack_dense(c >> 2, 1)], dim=-1)
    raise ValueError(f"bits must be one of {PACKED_BITS}, got {bits}")


def unpack(packed: torch.Tensor, bits: int, num_values: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 rows back to int32 codes."""
    p = packed.to(torch.int32)
    if bits == 8:
        return p
    if bits in (2, 4):
        return _unpack_dense(p, bits)
    if bits == 3:
        low = num_values // 4
        return _unpack_dense(p[..., :low], 2) | (_unpack_dense(p[..., low:], 1) << 2)
    raise ValueError(f"bits must be one of {PACKED_BITS}, got {bits}")
