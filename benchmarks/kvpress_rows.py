"""kvpress reference rows for the quality table: NVIDIA's kvpress (and the Hugging Face quantized
cache it documents) on the Hugging Face model, scored on the quality benchmark's perplexity windows.

Runs in its own environment (kvpress pins transformers<5.3; the project's has 5.x and vLLM):

    .venv-kvpress/bin/python -m benchmarks.kvpress_rows --model smollm2 --text essays \\
        --out results/kvpress-smollm2-essays.json

The windows are ``quality.prepare_data``'s: ``--ppl-windows`` stretches of ``max(--contexts) - 1``
tokens (the tokenizer's BOS, if any, then consecutive tokens of the text), float32 on the CPU.
Each window is scored in chunks of ``--chunk`` tokens; a chunk attends to its own tokens exactly
and to the context before it through the setting's cache:

- ``16-bit``: a DynamicCache filled chunk by chunk, the reference for KL;
- ``quanto-int4``, ``quanto-int2``: transformers' ``QuantizedCache`` (quanto backend, its defaults:
  a 128-token residual, groups of 64 consecutive elements, i.e. K and V both per token and head
  for head size 64), filled chunk by chunk as the KIVI reference fills its cache, so later chunks'
  K/V come from hidden states that read quantized context. Its rule keeps a flushed cache's next
  write whole at full precision: with 256-token chunks every other chunk sees the previous chunk
  unquantized, and a 2,048-token window ends with 256 full-precision tokens; KV vs 16-bit counts
  them (``held_full_precision``);
- ``PRESS-RATIO`` (e.g. ``expected_attention-0.727``): a kvpress press compresses only during a
  prefill, so for each chunk the whole prefix before it is prefilled afresh under the press
  (kvpress's pipeline does this with a context) and the chunk is then scored against the
  compressed prefix, with its true positions, as the pipeline scores a question. Unlike the other
  rows, the kept K/V come from exact prefills. KV vs 16-bit is the window's tokens over those a
  press keeps of them. Not on Gemma 3: kvpress leaves the sliding-window layers alone only for
  ``Gemma3ForConditionalGeneration``; on the text-only ``Gemma3ForCausalLM`` it would compress
  them too, and their window would then be masked in compressed positions.

Per setting: perplexity over the first C tokens of every window for each context C, and the mean KL
against the 16-bit run over the reference's top-20 tokens plus a rest bucket (``metrics.kl_top_k``,
every token present, since full distributions are at hand). KV vs 16-bit counts, for one request
of ``max(--contexts)`` tokens, what the cache holds once written, 16-bit statistics as a 16-bit
model would store them, against a 16-bit cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from benchmarks import metrics

MODELS = {"smollm2": "smollm2-135m-instruct", "qwen-coder": "qwen2.5-coder-0.5b-instruct", "gemma3": "gemma3-270m"}
TEXTS = {"essays": "essays", "code": "humaneval"}  # quality.TEXTS' names -> dataset
QUANTO = {"quanto-int4": 4, "quanto-int2": 2}
QUANTO_GROUP, QUANTO_RESIDUAL = 64, 128  # transformers' QuantizedCache defaults
PRESSES = {"expected_attention": "ExpectedAttentionPress", "snapkv": "SnapKVPress", "knorm": "KnormPress",
           "streaming_llm": "StreamingLLMPress"}
DEFAULT_SETTINGS = ["16-bit", "quanto-int4", "quanto-int2", "expected_attention-0.727", "expected_attention-0.8",
                    "snapkv-0.727", "snapkv-0.8"]
TOP_K = 20


def kv_vs_16bit_quantized(bits: int, group: int, head_size: int, context: int, full_precision: int) -> float:
    """A 16-bit cache's bytes over a quantized one's for ``context`` tokens: codes with a 16-bit scale
    and zero per ``group`` elements, and ``full_precision`` tokens of them at 16 bits."""
    dense = 2 * 2 * head_size  # K and V, 2 bytes an element, per token and KV head
    quantized = 2 * (bits * head_size / 8 + head_size / group * 2 * 2)
    return dense * context / ((context - full_precision) * quantized + full_precision * dense)


def kv_vs_16bit_press(ratio: float, context: int) -> float:
    """``context`` tokens over those a press keeps (kvpress's ``compute_n_kept``)."""
    return context / max(1, int(context * (1 - ratio)))


def held_full_precision(context: int, chunk: int, residual: int = QUANTO_RESIDUAL) -> int:
    """Tokens transformers' QuantizedLayer holds unquantized after ``context`` tokens written in
    ``chunk``-token steps: the first write is quantized whole; a later one joins the residual, and
    the whole cache is requantized when the residual already holds ``residual - 1`` tokens."""
    held = None  # None: nothing written yet; 0 after a flush
    for start in range(0, context, chunk):
        step = min(chunk, context - start)
        held = 0 if held is None or held + 1 >= residual else held + step
    return held or 0


def load_dataset_texts(name: str) -> list[str]:
    """``vllm_kvcompress.tools.datasets.dataset_texts``, loaded by path (the package imports more)."""
    spec = importlib.util.spec_from_file_location("kvc_datasets", ROOT / "vllm_kvcompress/tools/datasets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dataset_texts(name)


def windows(tokenizer, text: str, count: int, context: int) -> list[list[int]]:
    """The perplexity windows ``quality.prepare_data`` cuts for ``max(contexts) == context``."""
    source = "\n\n".join(load_dataset_texts(TEXTS[text]))
    prefix = tokenizer("").input_ids
    n = context - 1 - len(prefix)
    stream = tokenizer(source[:8 * count * n], add_special_tokens=False).input_ids
    if len(stream) < count * n:
        raise SystemExit(f"{text}: {len(stream)} tokens, {count * n} needed")
    return [prefix + stream[i * n:(i + 1) * n] for i in range(count)]


class Scorer:
    """A Hugging Face causal LM scoring windows chunk by chunk through a cache or a press."""

    def __init__(self, model_path, chunk: int):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.disable_progress_bar()
        self.chunk = chunk
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        config = self.model.config
        self.head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def _forward(self, ids: list[int], cache, position: int) -> torch.Tensor:
        """Next-token log-probabilities [len(ids), vocab] of ``ids`` placed at ``position`` after ``cache``."""
        positions = torch.arange(position, position + len(ids))[None]
        logits = self.model(torch.tensor([ids]), past_key_values=cache, position_ids=positions, use_cache=True).logits
        return logits[0].float().log_softmax(-1)

    @torch.no_grad()
    def sequential(self, window: list[int], cache):
        """Each chunk's log-probabilities, the chunks written one after another into ``cache``."""
        for start in range(0, len(window), self.chunk):
            yield self._forward(window[start:start + self.chunk], cache, start)

    @torch.no_grad()
    def pressed(self, window: list[int], press):
        """Each chunk's log-probabilities against its prefix, prefilled afresh and compressed by ``press``."""
        from transformers import DynamicCache

        yield self._forward(window[:self.chunk], DynamicCache(), 0)
        for start in range(self.chunk, len(window), self.chunk):
            cache = DynamicCache()
            with press(self.model):
                self.model.model(torch.tensor([window[:start]]), past_key_values=cache)
            yield self._forward(window[start:start + self.chunk], cache, start)

    def chunks(self, window: list[int], setting: str):
        from transformers import DynamicCache, QuantizedCache

        if setting == "16-bit":
            return self.sequential(window, DynamicCache())
        if setting in QUANTO:
            return self.sequential(window, QuantizedCache("quanto", self.model.config, nbits=QUANTO[setting]))
        return self.pressed(window, make_press(setting))

    def window(self, window: list[int], setting: str, ref_top=None):
        """(each token's logprob given its prefix, from the 2nd token on; the top-20 per position,
        or with ``ref_top`` the KL per position against it)."""
        lps = torch.cat(list(self.chunks(window, setting)))[:-1]  # the last position predicts past the window
        token_lp = lps.gather(1, torch.tensor(window[1:])[:, None])[:, 0].tolist()
        if ref_top is None:
            values, indices = lps.topk(TOP_K, -1)
            return token_lp, (indices, values)
        indices, values = ref_top
        test = lps.gather(1, indices)
        kls = [metrics.kl_top_k(dict(zip(i, v)), dict(zip(i, t)), TOP_K)[0]
               for i, v, t in zip(indices.tolist(), values.tolist(), test.tolist())]
        return token_lp, kls


def make_press(setting: str):
    import kvpress

    name, _, ratio = setting.rpartition("-")
    return getattr(kvpress, PRESSES[name])(compression_ratio=float(ratio))


def kv_vs_16bit(setting: str, head_size: int, context: int, chunk: int) -> float:
    if setting == "16-bit":
        return 1.0
    if setting in QUANTO:
        return kv_vs_16bit_quantized(QUANTO[setting], QUANTO_GROUP, head_size, context,
                                     held_full_precision(context, chunk))
    return kv_vs_16bit_press(float(setting.rpartition("-")[2]), context)


def check_setting(setting: str) -> str:
    name, _, ratio = setting.rpartition("-")
    if setting == "16-bit" or setting in QUANTO or (name in PRESSES and 0 < float(ratio or "nan") < 1):
        return setting
    raise argparse.ArgumentTypeError(f"{setting!r}: 16-bit, {', '.join(QUANTO)} or PRESS-RATIO with PRESS one of "
                                     f"{', '.join(PRESSES)} and 0 < RATIO < 1")


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "transformers", "kvpress", "optimum-quanto")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="smollm2")
    p.add_argument("--models-dir", type=Path, default=ROOT / "models")
    p.add_argument("--text", choices=TEXTS, default="essays")
    p.add_argument("--ppl-windows", type=int, default=4)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--settings", type=check_setting, nargs="+", default=DEFAULT_SETTINGS,
                   help="16-bit (the KL reference, always run first), quanto-int4, quanto-int2, PRESS-RATIO")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    settings = ["16-bit"] + [s for s in dict.fromkeys(args.settings) if s != "16-bit"]
    if args.model == "gemma3" and any(s.rpartition("-")[0] in PRESSES for s in settings):
        raise SystemExit("presses are not run on Gemma 3 (see the module docstring)")

    from tqdm import tqdm
    from transformers import AutoTokenizer

    path = args.models_dir / MODELS[args.model]
    context = max(args.contexts)
    data = windows(AutoTokenizer.from_pretrained(path), args.text, args.ppl_windows, context)
    scorer = Scorer(path, args.chunk)
    result = {"model": args.model, "text": args.text, "ppl_windows": args.ppl_windows, "contexts": args.contexts,
              "chunk": args.chunk, "dtype": "float32", "device": "cpu", "threads": torch.get_num_threads(),
              "quanto": {"residual_length": QUANTO_RESIDUAL, "q_group_size": QUANTO_GROUP, "axis": 0},
              "versions": versions(), "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    ref_tops = None
    bar = tqdm(total=len(settings) * len(data), desc=f"kvpress {args.model} {args.text}", unit="window")
    for setting in settings:
        bar.set_postfix_str(setting)
        start = time.time()
        scored = []
        for i, window in enumerate(data):
            scored.append(scorer.window(window, setting, ref_tops and ref_tops[i]))
            bar.update()
        logprobs = [lp for lp, _ in scored]
        row = {"setting": setting, "kv_vs_16bit": kv_vs_16bit(setting, scorer.head_size, context, args.chunk),
               **{f"ppl_{c}": metrics.perplexity([lp for w in logprobs for lp in w[:c - 1]]) for c in args.contexts}}
        if ref_tops is None:
            ref_tops = [top for _, top in scored]
        else:
            kls = [kl for _, window_kls in scored for kl in window_kls]
            row["kl"] = sum(kls) / len(kls)
        row["seconds"] = round(time.time() - start, 1)
        result["rows"].append(row)
        tqdm.write(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    bar.close()


if __name__ == "__main__":
    main()
