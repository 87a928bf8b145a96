"""Independent torch statement of the "quant" format's arithmetic, for tests.

Min-max asymmetric quantization over blocks of ``block`` tokens: K-style
statistics per channel over a block's tokens, V-style per token over channels;
zero = fp16(min), scale = fp16((max - zero) / (2**bits - 1)), code =
clamp(floor((x - zero) / scale + 1/2)). Written from the format's
description, not from the package's code.
"""

import torch


def _top(bits: int) -> float:
    """The highest code."""
    return float((1 << bits) - 1)


def _grid(values: torch.Tensor, dim: int, bits: int):
    """zero and step of the min-max grid of ``values`` along ``dim``."""
    mn, mx = values.amin(dim, keepdim=True), values.amax(dim, keepdim=True)
    zero = mn.half().float()
    return zero, ((mx - zero) / _top(bits)).clamp_min(1e-6).half().float()


def _quant(values: torch.Tensor, zero: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.floor((values - zero) / step + 0.5).clamp(0, _top(bits))


def fake_quant(x: torch.Tensor, bits: int, axis: str, block: int) -> torch.Tensor:
    """x: [seq, H, D] -> quantize-dequantize, block by block along seq."""
    if bits == 16:
        return x
    out = torch.empty_like(x, dtype=torch.float32)
    for start in range(0, x.shape[0], block):
        blk = x[start:start + block].float()
        zero, step = _grid(blk, 0 if axis == "channel" else -1, bits)
        out[start:start + block] = _quant(blk, zero, step, bits) * step + zero
    return out


def _span_grid(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """zero and scale (the step of the full-width codes) of the grid spanning lo..hi."""
    zero = lo.half().float()
    return zero, ((hi - zero) / _top(bits)).clamp_min(1e-6).half().float()


def appended_channel_quant(pieces: list[torch.Tensor], bits: int) -> tuple[torch.Tensor, int, int]:
    """K-style (per channel) quantization of one block written in ``pieces`` ([n_i, H, D] each), under
    the append rule: a channel whose new values all round onto its current grid (codes 0..top) keeps
    that grid and its earlier codes; otherwise the channel widens to the grid from lo = min(zero, new
    values) to hi = max(zero + scale * (2**bits - 1), new values), each end that a new value passed
    moved out by a further (hi - lo) / 8, and its decoded earlier values and the new ones are
    quantized on it. Returns the dequantized block and how many (piece, channel) appends kept their
    grid and how many re-encoded."""
    top = _top(bits)
    codes, zero, scale = None, None, None
    kept = reencoded = 0
    for piece in pieces:
        piece = piece.float()
        if codes is None:
            zero, scale = _span_grid(piece.amin(0, keepdim=True), piece.amax(0, keepdim=True), bits)
            codes = _quant(piece, zero, scale, bits)
            continue
        q = torch.floor((piece - zero) / scale + 0.5)
        fits = ((q >= 0) & (q <= top)).all(0, keepdim=True)
        values = torch.cat([codes * scale + zero, piece])
        new_lo, new_hi = piece.amin(0, keepdim=True), piece.amax(0, keepdim=True)
        grid_top = zero + scale * top
        lo, hi = torch.minimum(new_lo, zero), torch.maximum(new_hi, grid_top)
        margin = (hi - lo) / 8
        wide_zero, wide_scale = _span_grid(torch.where(new_lo < zero, lo - margin, lo),
                                           torch.where(new_hi > grid_top, hi + margin, hi), bits)
        new_zero, new_scale = torch.where(fits, zero, wide_zero), torch.where(fits, scale, wide_scale)
        codes = torch.where(fits, torch.cat([codes, q]), _quant(values, new_zero, new_scale, bits))
        zero, scale = new_zero, new_scale
        kept += int(fits.sum())
        reencoded += int((~fits).sum())
    return codes * scale + zero, kept, reencoded


def _clipped_grid(values: torch.Tensor, bits: int, ratios) -> tuple[torch.Tensor, torch.Tensor]:
    """zero and step per channel (dim 1) of ``values`` [n, D]: the min-max range shrunk about its
    middle by the first of ``ratios`` whose grid codes the values with the least squared error, each
    value's error weighted by its squared distance from the middle."""
    mn, mx = values.amin(0), values.amax(0)
    zeros, steps = [], []
    for c in range(values.shape[1]):
        best = None
        for ratio in ratios:
            mid, half = (mn[c] + mx[c]) * 0.5, (mx[c] - mn[c]) * 0.5
            lo, hi = (mn[c], mx[c]) if ratio == 1 else (mid - ratio * half, mid + ratio * half)
            zero, step = _span_grid(lo, hi, bits)
            error = (((_quant(values[:, c], zero, step, bits) * step + zero - values[:, c])
                      * (values[:, c] - mid)) ** 2).sum()
            if best is None or error < best[0]:
                best = (error, zero, step)
        zeros.append(best[1])
        steps.append(best[2])
    return torch.stack(zeros)[None], torch.stack(steps)[None]


def row_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [..., D] quantized-dequantized on each row's own min-max grid."""
    zero, step = _grid(x.float(), -1, bits)
    return _quant(x.float(), zero, step, bits) * step + zero


OUTLIER_K_BITS, OUTLIER_V_BITS = 8, 4  # an outlier row's codes (docs/formats.md)


def fake_quant_with_outliers(k: torch.Tensor, v: torch.Tensor, k_bits: int, v_bits: int, block: int,
                             count: int, clip_ratios=None) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Outlier tokens, stated from docs/formats.md: k, v [seq, H, D], each block written whole.
    Per block and head, the ``count`` tokens whose K has the largest z-score in any channel (mean and
    population standard deviation over the block's tokens, 1e-6 added to it) are kept apart, each
    row on its own grid (K on 8 bits, V on 4); K's grid per channel spans the block's other tokens
    only (an outlier's value may lie off it) and V is coded per token. A block of ``count`` tokens or fewer keeps none. ``clip_ratios`` (``k_clip``): each K
    channel's grid is narrowed (``_clipped_grid``), its error counted over the other tokens and, for
    each outlier, once more over the block's first other token. Returns k, v as read back and the
    chosen offsets, [block][head] -> sorted list."""
    out_k, out_v = fake_quant(k, k_bits, "channel", block).clone(), fake_quant(v, v_bits, "token", block).clone()
    chosen = []
    for start in range(0, k.shape[0], block):
        blk = k[start:start + block].float()
        n = blk.shape[0]
        per_head = []
        for h in range(blk.shape[1]):
            if n <= count:
                per_head.append([])
                continue
            x = blk[:, h]  # [n, D]
            z = ((x - x.mean(0)).abs() / (x.std(0, unbiased=False) + 1e-6)).max(1).values
            keep = sorted(int(i) for i in torch.argsort(z, descending=True)[:count])
            others = [i for i in range(n) if i not in keep]
            if clip_ratios:
                zero, step = _clipped_grid(x[others + [others[0]] * len(keep)], k_bits, clip_ratios)
            else:
                zero, step = _grid(x[others], 0, k_bits)
            out_k[start:start + n, h] = _quant(x, zero, step, k_bits) * step + zero
            for i in keep:
                out_k[start + i, h] = row_quant(k[start + i, h], OUTLIER_K_BITS)
                out_v[start + i, h] = row_quant(v[start + i, h], OUTLIER_V_BITS)
            per_head.append(keep)
        chosen.append(per_head)
    return out_k, out_v, chosen
