"""Independent torch statement of the "quant" format's arithmetic, for tests.

Min-max asymmetric quantization over blocks of ``block`` tokens: K-style
statistics per channel over a block's tokens, V-style per token over channels;
zero = fp16(min), scale = fp16((max - zero) / (2**bits - 1)), code =
clamp(floor((x - zero) / scale + 1/2)). With 3 bits (KVmix's packing) every
11th channel (index % 11 == 10) sits on a 2-bit grid spanning the same range,
its step 7/3 of the 3-bit step. Written from the format's description, not
from the package's code.
"""

import torch


def fake_quant(x: torch.Tensor, bits: int, axis: str, block: int) -> torch.Tensor:
    """x: [seq, H, D] -> quantize-dequantize, block by block along seq."""
    if bits == 16:
        return x
    top = float((1 << bits) - 1)
    levels = torch.full((x.shape[-1],), top)
    if bits == 3:
        levels[torch.arange(x.shape[-1]) % 11 == 10] = 3.0
    out = torch.empty_like(x, dtype=torch.float32)
    for start in range(0, x.shape[0], block):
        blk = x[start:start + block].float()
        dims = 0 if axis == "channel" else -1
        mn, mx = blk.amin(dims, keepdim=True), blk.amax(dims, keepdim=True)
        zero = mn.half().float()
        step = ((mx - zero) / top).clamp_min(1e-6).half().float() * (top / levels)
        codes = torch.minimum(torch.floor((blk - zero) / step + 0.5).clamp(min=0), levels)
        out[start:start + block] = codes * step + zero
    return out


def appended_channel_quant(pieces: list[torch.Tensor], bits: int) -> tuple[torch.Tensor, int, int]:
    """K-style (per channel) quantization of one block written in ``pieces`` ([n_i, H, D] each), under
    the append rule: a channel whose new values all round onto its current grid (codes 0..top) keeps
    that grid and its earlier codes; otherwise the channel's decoded earlier values and the new ones
    are quantized afresh. Returns the dequantized block and how many (piece, channel) appends kept
    their grid and how many re-encoded."""
    top = float((1 << bits) - 1)
    levels = torch.full((pieces[0].shape[-1],), top)
    if bits == 3:
        levels[torch.arange(pieces[0].shape[-1]) % 11 == 10] = 3.0
    ratio = top / levels

    def grid(values):
        zero = values.amin(0, keepdim=True).half().float()
        scale = ((values.amax(0, keepdim=True) - zero) / top).clamp_min(1e-6).half().float()
        return zero, scale * ratio

    def quant(values, zero, step):
        return torch.minimum(torch.floor((values - zero) / step + 0.5).clamp(min=0), levels)

    codes, zero, step = None, None, None
    kept = reencoded = 0
    for piece in pieces:
        piece = piece.float()
        if codes is None:
            zero, step = grid(piece)
            codes = quant(piece, zero, step)
            continue
        q = torch.floor((piece - zero) / step + 0.5)
        fits = ((q >= 0) & (q <= levels)).all(0, keepdim=True)
        values = torch.cat([codes * step + zero, piece])
        fresh_zero, fresh_step = grid(values)
        new_zero, new_step = torch.where(fits, zero, fresh_zero), torch.where(fits, step, fresh_step)
        codes = torch.where(fits, torch.cat([codes, q]), quant(values, new_zero, new_step))
        zero, step = new_zero, new_step
        kept += int(fits.sum())
        reencoded += int((~fits).sum())
    return codes * step + zero, kept, reencoded
