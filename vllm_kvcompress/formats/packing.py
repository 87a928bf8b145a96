"""Bit packing of integer codes along the last axis.

2, 4 and 8 bits pack densely into bytes. 3 bits use KVmix's word layout: each
little-endian 32-bit word holds ten 3-bit codes (bits 0..29) and one 2-bit code
(bits 30..31), so every 11th value of a row is stored with 2 bits. The caller
quantizes those slots on a 2-bit grid (see ``three_bit_slot_is_narrow``).
"""

from __future__ import annotations

import torch

PACKED_BITS = (2, 3, 4, 8)
_VALUES_PER_WORD_3BIT = 11


def packed_row_bytes(num_values: int, bits: int) -> int:
    """Bytes taken by one packed row of ``num_values`` codes."""
    if bits == 3:
        return 4 * -(-num_values // _VALUES_PER_WORD_3BIT)
    if bits in (2, 4, 8):
        return num_values * bits // 8
    raise ValueError(f"bits must be one of {PACKED_BITS}, got {bits}")


def three_bit_slot_is_narrow(num_values: int, device=None) -> torch.Tensor:
    """Bool mask over a row: True where the 3-bit layout keeps only 2 bits."""
    idx = torch.arange(num_values, device=device)
    return idx % _VALUES_PER_WORD_3BIT == _VALUES_PER_WORD_3BIT - 1


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (any int dtype, values < 2**bits) into uint8 rows."""
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    c = codes.to(torch.int64)
    if bits == 8:
        return c.to(torch.uint8)
    if bits in (2, 4):
        per_byte = 8 // bits
        if n % per_byte:
            raise ValueError(f"row length {n} is not a multiple of {per_byte} for {bits}-bit packing")
        c = c.reshape(*lead, n // per_byte, per_byte)
        shifts = torch.arange(per_byte, device=c.device) * bits
        return (c << shifts).sum(-1).to(torch.uint8)
    if bits == 3:
        words = -(-n // _VALUES_PER_WORD_3BIT)
        pad = words * _VALUES_PER_WORD_3BIT - n
        c = torch.nn.functional.pad(c, (0, pad)).reshape(*lead, words, _VALUES_PER_WORD_3BIT)
        shifts = torch.arange(_VALUES_PER_WORD_3BIT, device=c.device) * 3
        word = (c << shifts).sum(-1)  # < 2**32, fits int64
        byte_shifts = torch.arange(4, device=c.device) * 8
        return ((word.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(*lead, words * 4)
    raise ValueError(f"bits must be one of {PACKED_BITS}, got {bits}")


def unpack(packed: torch.Tensor, bits: int, num_values: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 rows back to int32 codes."""
    lead = packed.shape[:-1]
    p = packed.to(torch.int32)
    if bits == 8:
        return p
    if bits in (2, 4):
        per_byte = 8 // bits
        shifts = torch.arange(per_byte, device=p.device, dtype=torch.int32) * bits
        return ((p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*lead, num_values)
    if bits == 3:
        words = p.shape[-1] // 4
        b = p.to(torch.int64).reshape(*lead, words, 4)
        word = (b << (torch.arange(4, device=p.device) * 8)).sum(-1)
        shifts = torch.arange(_VALUES_PER_WORD_3BIT, device=p.device) * 3
        masks = torch.full((_VALUES_PER_WORD_3BIT,), 7, device=p.device, dtype=torch.int64)
        masks[-1] = 3
        codes = (word.unsqueeze(-1) >> shifts) & masks
        return codes.reshape(*lead, words * _VALUES_PER_WORD_3BIT)[..., :num_values].to(torch.int32)
    raise ValueError(f"bits must be one of {PACKED_BITS}, got {bits}")
