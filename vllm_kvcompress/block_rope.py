"""``k_block_frame``: K stored in the RoPE frame of its block's first position.

RoPE turns each channel pair of a key by an angle that grows with its position, so within a block of
128 tokens the fast pairs sweep whole circles and a per-channel grid must span them. Turned back by
its offset ``j`` in the block (``R(j)^-1``, ``j`` = position mod block size), every key of a block
sits in the frame of the block's first position ``p0``: ``R(p0)`` times the key before RoPE, one
fixed turn for the whole block, so each channel keeps about the range it has before RoPE. Reading a
key turns it forward by ``R(j)``: ``R(j) R(p0) = R(p0 + j)``, the key as the model made it, less the
grid's rounding. The offset is the slot's (slot mod block size): neither the write nor the kernels
need positions. NeoX-style RoPE over the whole head only; the table comes from the layer's own
rotary embedding, checked at load to turn by angles proportional to the position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention_layers import attention_layers
from .config import KVCompressionConfig, KVCompressionConfigError

ATTRIBUTE = "kvcompress_block_rope"
TABLE_ROWS = 1024  # offsets a table covers: blocks of up to this many tokens


@dataclass(frozen=True)
class BlockRope:
    """A layer's RoPE for offsets 0..TABLE_ROWS-1: ``cos_sin[j] = [cos | sin]`` of offset j's
    angles, float32 [TABLE_ROWS, D] (D/2 angles, NeoX halves)."""

    cos_sin: torch.Tensor
    # the decode kernel's copies, by code planes P (1, 2, 4): [rows, 2 D] float32, each row cos then sin
    # of every channel (channel c's angle is c mod D/2), channels in plane order (j * P + k is plane
    # k's j-th), so that a tile of a plane reads them contiguously
    planar: dict[int, torch.Tensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        half = self.cos_sin.shape[1] // 2
        channels = torch.arange(2 * half, device=self.cos_sin.device)
        copies = {}
        for planes in (1, 2, 4):
            order = channels.view(-1, planes).T.flatten() % half  # plane k's channels j * P + k, k-major
            copies[planes] = torch.cat([self.cos_sin[:, order], self.cos_sin[:, half + order]], dim=1).contiguous()
        object.__setattr__(self, "planar", copies)

    def turn(self, k: torch.Tensor, offsets: torch.Tensor, sign: float) -> torch.Tensor:
        """``k`` [..., H, D] turned by ``sign`` (+1 forward, -1 back) times the angles of ``offsets``
        (shape ``k.shape[:-2]``, or broadcastable to it); float32."""
        cos, sin = self.cos_sin[offsets.long()].unsqueeze(-2).chunk(2, dim=-1)
        a, b = k.float().chunk(2, dim=-1)
        return torch.cat([a * cos - sign * b * sin, b * cos + sign * a * sin], dim=-1)


def _refuse(layer_name: str, why: str) -> KVCompressionConfigError:
    return KVCompressionConfigError(f"kv-compression k_block_frame: {layer_name} {why} (allowed: k_block_frame "
                                    "false, or a model with NeoX-style RoPE over the whole head)")


def _table(rope, head_size: int, layer_name: str) -> torch.Tensor:
    """The layer's cos/sin for offsets 0..TABLE_ROWS-1 in float32, refused unless its turns compose
    (``R(p) R(j) = R(p + j)``, which storing keys in block frames relies on)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if not isinstance(rope, RotaryEmbedding):
        raise _refuse(layer_name, f"uses {type(rope).__name__} positions, not a rotary embedding")
    if not rope.is_neox_style or rope.rotary_dim != head_size:
        raise _refuse(layer_name, f"turns {rope.rotary_dim} of {head_size} channels, "
                                  f"{'NeoX' if rope.is_neox_style else 'GPT-J'} style")
    full = rope._compute_cos_sin_cache().float()
    rows = min(TABLE_ROWS, full.shape[0] // 2)
    cos, sin = full.chunk(2, dim=-1)
    p = rows  # near the start: float32 angles of far positions are off by up to position x 6e-8
    j = torch.arange(rows)
    composed_cos = cos[p] * cos[j] - sin[p] * sin[j]
    composed_sin = sin[p] * cos[j] + cos[p] * sin[j]
    error = max((composed_cos - cos[p + j]).abs().max().item(), (composed_sin - sin[p + j]).abs().max().item())
    if error > 1e-3:
        raise _refuse(layer_name, f"has a rotary embedding whose turns do not compose (off by {error:.3g}: scaled "
                                  "cos/sin, as YaRN's, or angles not proportional to the position)")
    return full[:rows].contiguous()


def attach_block_rope(model: torch.nn.Module, cfg: KVCompressionConfig) -> int:
    """Give every attention layer whose format keeps K in block frames its ``BlockRope``, layers with
    equal tables sharing one tensor (a decode launch is planned once for them); returns how many."""
    tables: list[torch.Tensor] = []
    count = 0
    for index, attn, parent in attention_layers(model):
        if not cfg.layer_format(index).k_block_frame:
            continue
        table = _table(getattr(parent, "rotary_emb", None), attn.head_size, attn.layer_name)
        same = next((t for t in tables if t.shape == table.shape and torch.equal(t.cpu(), table)), None)
        if same is None:
            same = table.to(next(parent.parameters()).device)
            tables.append(same)
        setattr(attn, ATTRIBUTE, BlockRope(same))
        count += 1
    return count
