"""KIVI as published, as a reference row of the quality benchmark: a plain torch fake-quantization
of the Hugging Face model's cache, written from the paper (Liu et al., 2024), not from this plugin.

K is quantized per channel over groups of ``group`` consecutive tokens, V per token over groups of
``group`` channels, both asymmetric min-max with float16 scale and zero. The newest tokens stay at
full precision in a residual: a context of n cached tokens holds its first ``n - n % residual``
tokens quantized (KIVI's code quantizes the residual whenever it reaches ``residual`` tokens, and a
prompt's remainder stays in it). ``residual`` 0 keeps only an incomplete group at full precision.

The model runs chunk by chunk with the same prompt chunks as the engine (``--chunk``), so a chunk's
tokens attend to earlier chunks through the quantized cache and to their own chunk exactly, as
KIVI's prefill does; later layers see the hidden states that quantized attention produced.

Setting names: ``kivi-BITS[-gGROUP][-rRESIDUAL]``; ``kivi-4`` is the paper's 4 bits, groups of
32, a residual of 128 tokens.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch

_NAME = re.compile(r"kivi-(?P<bits>[248])(?:-g(?P<group>\d+))?(?:-r(?P<residual>\d+))?")


@dataclass(frozen=True)
class KiviSpec:
    bits: int
    group: int = 32
    residual: int = 128

    @classmethod
    def parse(cls, name: str) -> "KiviSpec | None":
        """The spec a setting name asks for, or None where it is not a KIVI name."""
        m = _NAME.fullmatch(name)
        if m is None:
            return None
        spec = cls(int(m["bits"]), int(m["group"] or 32), int(m["residual"] or 128))
        if spec.residual % spec.group:
            raise SystemExit(f"setting {name!r}: the residual ({spec.residual}) must be a multiple of the group "
                             f"({spec.group} tokens)")
        return spec

    def quantized_tokens(self, num_cached: int) -> int:
        """How many of ``num_cached`` tokens are held quantized (the oldest ones)."""
        return num_cached - num_cached % (self.residual or self.group)

    def cached(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float):
        """The keys and values a chunk's attention reads: the oldest cached tokens quantized."""
        n = self.quantized_tokens(key.shape[2] - query.shape[2])
        if n:
            key = torch.cat([fake_quant_k(key[:, :, :n], self.bits, self.group), key[:, :, n:]], 2)
            value = torch.cat([fake_quant_v(value[:, :, :n], self.bits, self.group), value[:, :, n:]], 2)
        return key, value

    def kv_vs_16bit(self, head_size: int, context: int) -> float:
        """KV tokens against a 16-bit cache in the same memory, for requests of ``context`` tokens:
        codes with float16 scale and zero per group, and room for a full 16-bit residual a request."""
        k_stats = 2 * 2 * head_size / self.group  # float16 scale and zero: per channel and group of tokens
        v_stats = 2 * 2 * head_size / min(self.group, head_size)  # per token and group of channels
        quantized = 2 * self.bits * head_size / 8 + k_stats + v_stats
        dense = 2 * 2 * head_size
        residual = min(self.residual, context)
        return dense * context / ((context - residual) * quantized + residual * dense)


def _min_max(x: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """Asymmetric min-max fake quantization of ``x`` with statistics over ``dim`` (float16 scale, zero)."""
    top = 2 ** bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    zero = lo.half().float()
    scale = ((hi - zero) / top).half().float().clamp_min(1e-8)
    return torch.clamp(torch.floor((x - zero) / scale + 0.5), 0, top) * scale + zero


def fake_quant_k(k: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """k [..., tokens, d], tokens a multiple of ``group``: per channel over each group of tokens."""
    *lead, n, d = k.shape
    return _min_max(k.float().reshape(*lead, n // group, group, d), -2, bits).reshape(k.shape).to(k.dtype)


def fake_quant_v(v: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """v [..., tokens, d]: per token over each group of ``group`` channels (a head's ``d`` at most)."""
    *lead, n, d = v.shape
    group = min(group, d)
    return _min_max(v.float().reshape(*lead, n, d // group, group), -1, bits).reshape(v.shape).to(v.dtype)


class KiviModel:
    """A Hugging Face causal LM (float32, on the CPU) whose attention reads a KIVI cache."""

    ATTENTION = "kivi_reference"

    def __init__(self, model_path, chunk: int | None):  # None: a window in one chunk
        from transformers import AttentionInterface, AutoModelForCausalLM
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        self.spec: KiviSpec | None = None
        self.chunk = chunk

        def attention(module, query, key, value, attention_mask, **kwargs):
            if self.spec is not None:
                # key/value hold every cached token and then the chunk's own (no token leaves the cache)
                scale = kwargs.get("scaling") or module.scaling
                key, value = self.spec.cached(module, query, key, value, scale)
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(self.ATTENTION, attention)
        AttentionMaskInterface.register(self.ATTENTION, sdpa_mask)  # sliding windows masked as with sdpa
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                          attn_implementation=self.ATTENTION).eval()
        self.head_size = getattr(self.model.config, "head_dim", None) or \
            self.model.config.hidden_size // self.model.config.num_attention_heads

    @contextlib.contextmanager
    def using(self, spec):
        """Attention reads the cache as ``spec`` (a ``KiviSpec`` or ``zipcache_sim.ZipSimSpec``) holds it."""
        self.spec = spec
        try:
            yield self
        finally:
            self.spec = None

    @torch.no_grad()
    def _extend(self, ids: list[int], cache):
        """Feed ``ids`` after what ``cache`` holds, in chunks; yields the log-probabilities of the
        next token, [positions, vocab], a few hundred positions at a time (a vocabulary's logits for a
        whole window would not fit in memory)."""
        step = self.chunk or len(ids)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        for start in range(0, len(ids), step):
            hidden = self.model.model(torch.tensor([ids[start:start + step]]), past_key_values=cache,
                                      use_cache=True).last_hidden_state[0]
            for part in hidden.split(256):
                logits = self.model.lm_head(part).float()
                if cap:
                    logits = torch.tanh(logits / cap) * cap
                yield torch.log_softmax(logits, -1)

    def window_logprobs(self, window: list[int], top_k: int) -> tuple[list[float], list[dict[int, float]]]:
        """As the engine's prompt logprobs: each token's logprob given its prefix (from the 2nd
        token on), and the ``top_k`` most likely tokens per position."""
        from transformers import DynamicCache

        token_lp: list[float] = []
        tops: list[dict[int, float]] = []
        pos = 0
        for logprobs in self._extend(window, DynamicCache()):
            targets = window[pos + 1:pos + 1 + logprobs.shape[0]]
            logprobs = logprobs[:len(targets)]  # the last position predicts past the window
            token_lp += logprobs.gather(1, torch.tensor(targets)[:, None])[:, 0].tolist()
            values, indices = logprobs.topk(top_k, -1)
            tops += [dict(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
            pos += logprobs.shape[0]
        return token_lp, tops

    @torch.no_grad()
    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        """``num_tokens`` greedy tokens after ``prompt`` (end-of-sequence ignored), one at a time."""
        from transformers import DynamicCache

        cache = DynamicCache()
        *_, last = self._extend(prompt, cache)
        out = [int(last[-1].argmax())]
        while len(out) < num_tokens:
            *_, last = self._extend(out[-1:], cache)
            out.append(int(last[-1].argmax()))
        return out
