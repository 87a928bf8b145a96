"""What keeping a few tokens of each block exact does to low-bit pages, on a real model and text.

A torch fake quantization of the Hugging Face model's cache, run chunk by chunk as the engine runs
a prompt (``benchmarks.kivi.KiviModel``): each chunk attends to its own K/V exactly and to earlier
chunks' through blocks of 128 tokens, K per channel and V per token with float16 statistics. Kept
tokens are left out of K's statistics and read back exactly (``--kept-bits 8``: coded per token on
8 bits instead). Perplexity over the quality benchmark's windows (``--ppl-windows`` of 2,048
tokens); one line per setting.

    python benchmarks/experiments/outliers.py --model-dir models/smollm2-135m-instruct --text essays \\
        3/2/0 3/2/1/deviant 3/2/1/first-token 3/2/1/block-start 3/2/1/deviant/narrow3 ...

A setting is ``K/V/COUNT[/RULE][/OPTIONS]``: RULE ``deviant`` (each block's COUNT tokens of largest
per-channel z-score, ``formats.outliers``' rule), ``first-token`` (the sequence's first COUNT
tokens), ``block-start`` (each block's first COUNT). OPTIONS: ``narrow3`` (3 bits in KVmix's word
layout, every 11th channel on a 2-bit grid, as the pages store them; else dense 3 bits),
``vscale`` (V channels divided by sqrt(max |v|) first, ZipCache's), ``vgroup64`` (V statistics per
64 channels), ``recentR`` (the context's newest R tokens read exactly, as KIVI's residual: a
window that costs memory only for the tokens it holds, R x 16 bits a request), ``prerope`` (K
quantized before its rotary embedding, KVQuant's pre-RoPE keys: rotated back by each token's
position, quantized, rotated again), ``blockrope`` (K turned back only by its offset in its block,
so a block's keys share the frame of its first position), ``clip`` / ``clipk`` / ``clipv`` (each statistics group's range
narrowed to the least squared error, values beyond it on the end levels; ``wclip`` / ``wclipk`` /
``wclipv``: each value's error weighted by its squared distance from the range's middle, the pages'
``k_clip``), ``konly`` (kept tokens'
K exact, their V coded per token as every other token's), ``keptv4`` (with ``--kept-bits 8``: kept
tokens' V on 4 bits), ``vrot`` (V's channels turned by a Hadamard rotation before coding and back
after, QuaRot's: attention's output would be turned back once instead of every V), ``blockN``
(blocks of N tokens instead of 128: K's statistics and the outlier choice per N tokens).
"""

from __future__ import annotations

import argparse
import inspect
import time
from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import rotate_half

from vllm_kvcompress.formats import CLIP_RATIOS  # the pages' ratios
from vllm_kvcompress.formats.rotation import hadamard  # the pages' turn of V (``v_rotation``)


def _grid_codes(x: torch.Tensor, ref: torch.Tensor, dim: int, bits: int, narrow3: bool,
                clip: str | None = None) -> torch.Tensor:
    """``x`` quantized on the min-max grid of ``ref`` along ``dim`` (float16 statistics). ``clip``:
    each group's range shrunk about its middle by the ratio of CLIP_RATIOS with the least squared
    error over ``ref`` (values beyond it take the end levels); ``"weighted"``: each value's error
    weighted by its squared distance from the middle (the pages' rule)."""
    top = torch.full((x.shape[-1],), float(2 ** bits - 1))
    if narrow3 and bits == 3:
        top[torch.arange(x.shape[-1]) % 11 == 10] = 3.0
    if dim != -2:  # per token: levels along the token axis are all the same
        top = top.max()
    lo, hi = ref.amin(dim, keepdim=True), ref.amax(dim, keepdim=True)

    def coded(v, lo, hi):
        zero = lo.half().float()
        step = ((hi - zero) / (2 ** bits - 1)).half().float().clamp_min(1e-8) * ((2 ** bits - 1) / top)
        return torch.minimum(torch.floor((v - zero) / step + 0.5).clamp(min=0), top) * step + zero

    if clip:
        mid, half = (lo + hi) / 2, (hi - lo) / 2
        weight = (ref - mid).square() if clip == "weighted" else 1.0
        errors = torch.stack([((coded(ref, mid - a * half, mid + a * half) - ref).square() * weight).sum(dim, keepdim=True)
                              for a in CLIP_RATIOS])
        ratio = torch.tensor(CLIP_RATIOS)[errors.argmin(0)]
        lo, hi = mid - ratio * half, mid + ratio * half
    return coded(x, lo, hi)


@dataclass
class Setting:
    k_bits: int
    v_bits: int
    count: int
    rule: str = "deviant"
    options: tuple[str, ...] = ()
    kept_bits: int = 16
    block: int = 128
    rotary: object = None  # the model's rotary embedding, for ``prerope``

    @classmethod
    def parse(cls, text: str, kept_bits: int) -> "Setting":
        k, v, count, *rest = text.split("/")
        rule = rest[0] if rest and rest[0] in ("deviant", "first-token", "block-start") else "deviant"
        options = tuple(r for r in rest if r != rule)
        return cls(int(k), int(v), int(count), rule, options, kept_bits, _numbered(options, "block", 128))

    def _kept(self, k: torch.Tensor, start: int) -> torch.Tensor:
        """[H, n] bool: the block's tokens kept (k [H, n, D] from token ``start``)."""
        keep = torch.zeros(k.shape[:2], dtype=torch.bool)
        if self.rule == "first-token" and start == 0:
            keep[:, :self.count] = True
        elif self.rule == "block-start":
            keep[:, :self.count] = True
        elif self.rule == "deviant" and k.shape[1] > self.count:
            z = ((k - k.mean(1, keepdim=True)).abs() / (k.std(1, keepdim=True, unbiased=False) + 1e-6)).amax(-1)
            keep.scatter_(1, z.topk(self.count, 1).indices, True)
        return keep

    def _v(self, v: torch.Tensor) -> torch.Tensor:
        if "vscale" in self.options:
            c = v.abs().amax(-2, keepdim=True).clamp_min(1e-6).sqrt().half().float()
            return _grid_codes(v / c, v / c, -1, self.v_bits, False, self._clips("v")) * c
        if "vgroup64" in self.options and v.shape[-1] > 64:
            g = v.unflatten(-1, (v.shape[-1] // 64, 64))
            return _grid_codes(g, g, -1, self.v_bits, False, self._clips("v")).flatten(-2)
        return _grid_codes(v, v, -1, self.v_bits, "narrow3" in self.options, self._clips("v"))

    def _clips(self, tensor: str) -> str | None:
        """How ``tensor`` ("k" or "v") is clipped: ``clip`` (both), ``clipk``, ``clipv`` (plain squared
        error), ``wclip``, ``wclipk``, ``wclipv`` (weighted), else None."""
        if "wclip" in self.options or f"wclip{tensor}" in self.options:
            return "weighted"
        return "plain" if "clip" in self.options or f"clip{tensor}" in self.options else None

    def cached(self, module, query, key, value, scale):
        """The keys and values a chunk's attention reads: cached blocks through the format."""
        n = key.shape[2] - query.shape[2]
        k_out, v_out = key.clone(), value.clone()
        cos, sin = self._rope_tables(module, n)
        for a in range(0, n, self.block):
            b = min(a + self.block, n)
            k, v = key[0, :, a:b].float(), value[0, :, a:b].float()
            if cos is None:
                angles = None
            elif "blockrope" in self.options:  # turned back only by the token's offset in its block
                angles = (cos[:b - a], sin[:b - a])
            else:
                angles = (cos[a:b], sin[a:b])
            k_coded = _turn(k, angles, -1.0)  # the frame K is quantized in: before RoPE with ``prerope``
            keep = self._kept(k_coded, a)[..., None]
            others = torch.where(keep, k_coded.masked_fill(keep, float("nan")).nanmedian(1, keepdim=True).values,
                                 k_coded)
            qk = _turn(_grid_codes(k_coded, others, -2, self.k_bits, "narrow3" in self.options, self._clips("k")),
                       angles, 1.0)
            turn_v = hadamard(v.shape[-1]) if "vrot" in self.options else None
            if turn_v is not None:
                v = v @ turn_v
            qv = self._v(v)
            exact_k, exact_v = k, v
            if self.kept_bits == 8:
                exact_k = _turn(_grid_codes(k_coded, k_coded, -1, 8, False), angles, 1.0)
                exact_v = _grid_codes(v, v, -1, 4 if "keptv4" in self.options else 8, False)
            if "konly" in self.options:
                exact_v = qv
            k_out[0, :, a:b] = torch.where(keep, exact_k, qk).to(key.dtype)
            v_read = torch.where(keep, exact_v, qv)
            v_out[0, :, a:b] = (v_read if turn_v is None else v_read @ turn_v.T).to(value.dtype)
        window = slice(max(n - self._recent(), 0), n)  # empty without ``recentR``
        k_out[0, :, window], v_out[0, :, window] = key[0, :, window], value[0, :, window]
        return k_out, v_out

    def _rope_tables(self, module, n: int):
        """cos, sin [n, D] of positions 0..n-1 (a window's cache starts at its first token) for
        ``prerope``, with the layer's own embedding where layers differ (Gemma 3's sliding ones);
        else (None, None)."""
        if "prerope" not in self.options and "blockrope" not in self.options:
            return None, None
        x = torch.zeros(1, n, 1)
        positions = torch.arange(n)[None]
        types = getattr(module.config, "layer_types", None)
        if types and "layer_type" in inspect.signature(self.rotary.forward).parameters:
            cos, sin = self.rotary(x, positions, types[module.layer_idx])
        else:
            cos, sin = self.rotary(x, positions)
        return cos[0].float(), sin[0].float()

    def _recent(self) -> int:
        """R of a ``recentR`` option, else 0."""
        return _numbered(self.options, "recent", 0)


def _numbered(options: tuple[str, ...], name: str, default: int) -> int:
    """N of an option ``nameN`` (``recent128``, ``block64``), else ``default``."""
    return next((int(o[len(name):]) for o in options if o.startswith(name) and o[len(name):].isdigit()), default)


def _turn(x: torch.Tensor, angles, sign: float) -> torch.Tensor:
    """``x`` rotated as RoPE rotates it by ``sign`` times the angles whose (cos, sin) ``angles`` holds
    (None: ``x`` as it is)."""
    if angles is None:
        return x
    cos, sin = angles
    return x * cos + sign * rotate_half(x) * sin


def main() -> None:
    from transformers import AutoTokenizer

    from benchmarks.kivi import KiviModel
    from benchmarks.quality import Sizes, perplexity_at, prepare_data

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="+")
    parser.add_argument("--model-dir", default="models/smollm2-135m-instruct")
    parser.add_argument("--text", default="essays", choices=["essays", "code"])
    parser.add_argument("--ppl-windows", type=int, default=4)
    parser.add_argument("--kept-bits", type=int, default=16, choices=[8, 16])
    args = parser.parse_args()
    sizes = Sizes(contexts=(1024, 2048), ppl_windows=args.ppl_windows, greedy_prompts=0, needle=(), gsm8k=0)
    data = prepare_data(AutoTokenizer.from_pretrained(args.model_dir), sizes, text=args.text)
    model = KiviModel(args.model_dir, sizes.chunk)

    def perplexity(spec) -> float:
        with model.using(spec):
            return perplexity_at([model.window_logprobs(w, 1)[0] for w in data.windows], 2048)

    base = perplexity(None)
    print(f"{args.text}: 16-bit perplexity @2k {base:.3f}", flush=True)
    for text in args.settings:
        start = time.time()
        setting = Setting.parse(text, args.kept_bits)
        setting.rotary = model.model.model.rotary_emb
        ppl = perplexity(setting)
        print(f"{text}: {ppl:.3f} ({100 * (ppl / base - 1):+.2f}%, {time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
