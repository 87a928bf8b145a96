"""Quality of each KV setting on real weights, measured through the vLLM engine itself.

Per setting, one in-process engine (the compressed pages are what attention reads, prompt
tokens included) and:

- perplexity on a long text (``TEXTS``: Paul Graham's essays by default, held out: the KVmix
  profile used GSM8K; or HumanEval's Python code) from the engine's own prompt logprobs, at
  several contexts: the perplexity at context L is taken over the first L tokens of each window
  (a causal model scores them as an L-token window would);
- mean KL divergence of the next-token distributions against the uncompressed cache, over the
  same positions, from the top-k prompt logprobs (see ``metrics.kl_top_k``);
- greedy agreement with the uncompressed cache over generated tokens, after prompts cut from
  the same text;
- needle retrieval in the essays whatever the text (RULER's niah_single_2 form, ``needle.py``)
  at several lengths, for a compressed setting only at the lengths where the uncompressed cache
  finds some needles;
- GSM8K accuracy, only when the uncompressed cache scores clearly above zero;
- HumanEval pass@1 (``humaneval.py``) on every setting, when asked for (``Sizes.humaneval``).

The uncompressed run (``auto``) comes first: it is the reference for KL and agreement.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from dataclasses import asdict, dataclass, replace

from tqdm import tqdm

from . import humaneval, metrics, needle, report, settings
from .frontier import frontier
from .kivi import KiviModel, KiviSpec
from .zipcache_sim import ZipSimSpec
from .models import Model

GSM8K_MIN = 0.1  # GSM8K runs on the compressed settings only above this 16-bit accuracy
# --text: where the perplexity windows and greedy prompts come from, (dataset, what it is)
TEXTS = {"essays": ("essays", "Paul Graham's essays"),
         "code": ("humaneval", "HumanEval's Python problems with their canonical solutions")}


@dataclass(frozen=True)
class Sizes:
    contexts: tuple[int, ...] = (1024, 4096, 8192)  # perplexity at these contexts (tokens)
    ppl_windows: int = 1  # essay windows of max(contexts) tokens
    greedy_prompts: int = 4
    greedy_context: int = 512
    greedy_tokens: int = 256
    needle: tuple[tuple[int, int], ...] = ((1024, 4), (2048, 2), (4096, 2), (8192, 1))  # (length, samples)
    gsm8k: int = 40  # questions of the 16-bit check
    gsm8k_tokens: int = 256
    humaneval: int = 0  # the first N HumanEval problems, on every setting (0: not run)
    humaneval_tokens: int = 512
    top_k: int = 20  # the reference's most likely tokens per position that KL is taken over
    test_top_k: int = 100  # prompt logprobs per position asked of the other settings (so few are missing)
    # prompt chunks of at most this many tokens: a chunk attends to its own tokens exactly and to
    # earlier context through the pages, so small chunks make prompt logprobs show what a generated
    # token sees (docs/quality.md)
    chunk: int = 256
    block_size: int | None = None  # tokens a KV block, vLLM's --block-size (None: the backend's choice)

    @property
    def max_len(self) -> int:
        return max(self.contexts + tuple(n for n, _ in self.needle) +
                   (self.greedy_context + self.greedy_tokens,) +
                   ((humaneval.PROMPT_ROOM + self.humaneval_tokens,) if self.humaneval else ()))


FULL = Sizes()
SMALL = Sizes(contexts=(128, 256), greedy_prompts=2, greedy_context=64, greedy_tokens=16, needle=((512, 2),),
              gsm8k=2, gsm8k_tokens=16, humaneval_tokens=64, chunk=64)


@dataclass
class Data:
    windows: list[list[int]]
    greedy: list[list[int]]
    needles: dict[int, list[needle.Sample]]
    gsm8k: list[tuple[list[int], str]]
    humaneval: list[tuple[list[int], dict]]


def prepare_data(tokenizer, sizes: Sizes, seed: int = 0, text: str = "essays") -> Data:
    """Perplexity windows and greedy prompts from ``text`` (a name of ``TEXTS``); needles in the
    essays, as RULER hides them."""
    from vllm_kvcompress.tools.datasets import dataset_texts

    essays = dataset_texts("essays")[0]
    source = "\n\n".join(dataset_texts(TEXTS[text][0]))
    prefix = tokenizer("").input_ids  # the BOS token, for tokenizers that start with one
    n_ppl, n_greedy = max(sizes.contexts) - 1 - len(prefix), sizes.greedy_context - len(prefix)
    need = sizes.ppl_windows * n_ppl + sizes.greedy_prompts * n_greedy
    stream = tokenizer(source[:8 * need], add_special_tokens=False).input_ids
    if len(stream) < need:
        raise SystemExit(f"{text}: {len(stream)} tokens, {need} needed")
    windows = [prefix + stream[i * n_ppl:(i + 1) * n_ppl] for i in range(sizes.ppl_windows)]
    start = sizes.ppl_windows * n_ppl
    greedy = [prefix + stream[start + i * n_greedy:start + (i + 1) * n_greedy] for i in range(sizes.greedy_prompts)]
    needles = {length: needle.make_samples(tokenizer, essays, length, count, seed + length)
               for length, count in sizes.needle}
    return Data(windows, greedy, needles, gsm8k_prompts(tokenizer, sizes.gsm8k),
                humaneval.prompts(tokenizer, sizes.humaneval))


def gsm8k_prompts(tokenizer, count: int) -> list[tuple[list[int], str]]:
    """The first ``count`` GSM8K test questions (chat template where the tokenizer has one), gold answers."""
    import json

    from vllm_kvcompress.tools.datasets import dataset_file

    rows = [json.loads(line) for line in dataset_file("gsm8k").read_text().splitlines() if line.strip()][:count]
    out = []
    for r in rows:
        question = f"{r['question']}\nSolve it step by step, then give the final answer as a number."
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        else:
            ids = tokenizer(f"Question: {question}\nAnswer:").input_ids
        out.append((list(ids), r["answer"].split("####")[-1].strip().replace(",", "")))
    return out


@contextlib.contextmanager
def engine(model: Model, setting, sizes: Sizes, dtype: str, kv_bytes: int):
    """One vLLM engine in this process for ``setting`` (a name of ``settings``, or a config dict)."""
    from vllm import LLM

    kwargs = {"additional_config": {"kv_compression": setting}} if isinstance(setting, dict) else \
        settings.llm_kwargs(setting)
    # context before the current chunk is read from the pages (vLLM wants a step's token budget to
    # hold one token of each request it runs)
    kwargs |= {"enable_chunked_prefill": True, "max_num_batched_tokens": sizes.chunk,
               "max_num_seqs": min(256, sizes.chunk)}
    if sizes.block_size is not None:  # K's per-channel statistics cover a block
        kwargs["block_size"] = sizes.block_size
    llm = LLM(str(model.path), dtype=dtype, enforce_eager=True, seed=0, max_model_len=sizes.max_len,
              kv_cache_memory_bytes=kv_bytes, max_logprobs=sizes.test_top_k, **kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def kv_tokens(llm) -> int:
    """The KV capacity in tokens that the engine allocated."""
    cc = llm.llm_engine.vllm_config.cache_config
    return cc.num_gpu_blocks * cc.block_size


def kv_vs_16bit(llm, setting) -> float | None:
    """KV tokens against vLLM's bfloat16 cache in the same memory (the page arithmetic the plugin
    logs, whatever dtype this engine runs in); None where not known (vLLM's int4 cache)."""
    import torch

    from vllm_kvcompress.engine_config import ModelKVShape, active_config, capacity_report

    if setting == settings.BASELINE:
        return 1.0
    if isinstance(setting, str) and setting.startswith("fp8"):
        return 2.0
    vllm_config = llm.llm_engine.vllm_config
    cfg = active_config(vllm_config)
    if cfg is None:
        return None
    return capacity_report(cfg, replace(ModelKVShape.of(vllm_config), dtype=torch.bfloat16))[0]


def _generate(llm, prompts: list[list[int]], **params):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(**params), use_tqdm=False)


def window_logprobs(llm, windows: list[list[int]], top_k: int) -> list[tuple[list[float], list[metrics.TopK]]]:
    """Per window: each token's logprob given its prefix, and the top-k per position. Windows go one
    at a time, so that each is split into chunks at multiples of the chunk size (together, a window
    would start in the step budget another left over, and its chunks would end inside blocks), as
    the KIVI reference splits them."""
    outs = [o for w in windows for o in _generate(llm, [w], max_tokens=1, temperature=0.0, prompt_logprobs=top_k)]
    return [(metrics.prompt_token_logprobs(o.prompt_token_ids, o.prompt_logprobs), metrics.top_k(o.prompt_logprobs))
            for o in outs]


def perplexity_at(logprobs: list[list[float]], context: int) -> float:
    """Perplexity over the first ``context`` tokens of every window (``context - 1`` predictions each)."""
    return metrics.perplexity([lp for window in logprobs for lp in window[:context - 1]])


def _distribution_columns(windows, sizes: Sizes, ref: dict | None) -> dict:
    """Perplexity at each context and, against the reference, mean KL over the windows' positions."""
    logprobs = [lp for lp, _ in windows]
    row = {f"ppl_{ctx}": perplexity_at(logprobs, ctx) for ctx in sizes.contexts}
    if ref is not None:
        kls = [metrics.kl_top_k(r, t, sizes.top_k) for rw, (_, tw) in zip(ref["top"], windows)
               for r, t in zip(rw, tw)]
        row["kl"] = sum(k for k, _ in kls) / len(kls)
        row["kl_missing"] = sum(m for _, m in kls) / len(kls)
    return row


def _greedy_columns(greedy: list[list[int]], ref: dict | None) -> dict:
    if ref is None:
        return {}
    agree = [metrics.greedy_agreement(r, g) for r, g in zip(ref["greedy"], greedy)]
    return {"greedy_match": sum(a for a, _ in agree) / len(agree),
            "greedy_first_diff": sum(f for _, f in agree) / len(agree)}


def reference_spec(setting, block_size: int | None = None) -> KiviSpec | ZipSimSpec | None:
    """The Hugging Face reference a setting names (``kivi-...``, ``zipsim-...``, the latter on the
    engine's blocks), or None (an engine row)."""
    if not isinstance(setting, str):
        return None
    zipsim = ZipSimSpec.parse(setting)
    if zipsim is not None and block_size is not None:
        zipsim.block = block_size
    return KiviSpec.parse(setting) or zipsim


def evaluate_reference(model: KiviModel, spec: KiviSpec | ZipSimSpec, data: Data, sizes: Sizes, ref: dict,
                       bar: tqdm) -> dict:
    """A reference row on the Hugging Face model (KIVI as published, ``kivi.py``; ZipCache's choice
    simulated, ``zipcache_sim.py``): perplexity, KL and greedy agreement on the same windows and
    prompts as the engine's rows; needles, GSM8K and HumanEval are not run."""
    with model.using(spec):
        bar.set_postfix_str("perplexity")
        windows = [model.window_logprobs(w, sizes.test_top_k) for w in data.windows]
        bar.set_postfix_str("greedy")
        greedy = [model.greedy(p, sizes.greedy_tokens) for p in data.greedy]
    return {"kv_vs_16bit": spec.kv_vs_16bit(model.head_size, max(sizes.contexts)),
            **_distribution_columns(windows, sizes, ref), **_greedy_columns(greedy, ref)}


def evaluate(llm, setting, data: Data, sizes: Sizes, ref: dict | None, needle_lengths, run_gsm8k: bool,
             bar: tqdm) -> tuple[dict, dict]:
    """One setting's row, and what a later setting compares against (this one's top-k and greedy tokens)."""
    row: dict = {"kv_tokens": kv_tokens(llm), "kv_vs_16bit": kv_vs_16bit(llm, setting)}
    bar.set_postfix_str("perplexity")
    windows = window_logprobs(llm, data.windows, sizes.top_k if ref is None else sizes.test_top_k)
    row |= _distribution_columns(windows, sizes, ref)
    bar.set_postfix_str("greedy")
    outs = _generate(llm, data.greedy, max_tokens=sizes.greedy_tokens, temperature=0.0, ignore_eos=True)
    greedy = [list(o.outputs[0].token_ids) for o in outs]
    row |= _greedy_columns(greedy, ref)
    for length in needle_lengths:
        bar.set_postfix_str(f"needle {length}")
        samples = data.needles[length]
        outs = _generate(llm, [s.prompt_ids for s in samples], max_tokens=16, temperature=0.0)
        row[f"needle_{length}"] = sum(needle.score(o.outputs[0].text, s.answer)
                                      for o, s in zip(outs, samples)) / len(samples)
    if run_gsm8k and data.gsm8k:
        bar.set_postfix_str("gsm8k")
        outs = _generate(llm, [p for p, _ in data.gsm8k], max_tokens=sizes.gsm8k_tokens, temperature=0.0)
        row["gsm8k"] = sum(metrics.last_number(o.outputs[0].text) == gold
                           for o, (_, gold) in zip(outs, data.gsm8k)) / len(data.gsm8k)
    if data.humaneval:
        bar.set_postfix_str("humaneval")
        outs = _generate(llm, [p for p, _ in data.humaneval], max_tokens=sizes.humaneval_tokens, temperature=0.0)
        row["humaneval"] = humaneval.pass_at_1([problem for _, problem in data.humaneval],
                                               [o.outputs[0].text for o in outs])
    return row, {"top": [top for _, top in windows], "greedy": greedy}


def error_text(err: BaseException) -> str:
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def run(model: Model, kv_settings: list, sizes: Sizes, out_dir, dtype: str, kv_bytes: int,
        names: list[str] | None = None, text: str = "essays") -> dict:
    """Evaluate every setting (the baseline first); results are written after each one."""
    from transformers import AutoTokenizer

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in this process, one at a time
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    print(f"preparing data for {model.name}", flush=True)
    data = prepare_data(tokenizer, sizes, text=text)
    names = names or [settings.label(s) for s in kv_settings]
    todo = [(n, s) for n, s in zip(names, kv_settings)]
    if settings.BASELINE not in kv_settings:
        todo.insert(0, (settings.label(settings.BASELINE), settings.BASELINE))
    todo.sort(key=lambda ns: ns[1] != settings.BASELINE)
    # reference rows by setting, parsed before any engine starts (a bad name stops the run here)
    reference_specs = {s: reference_spec(s, sizes.block_size) for _, s in todo if isinstance(s, str)}
    result = {"bench": "quality", "model": model.name, "dtype": dtype, "kv_cache_memory_bytes": kv_bytes,
              "text": text, "text_source": TEXTS[text][1], "sizes": asdict(sizes), "device": report.device(),
              "rows": []}
    ref, needle_lengths, run_gsm8k = None, [n for n, _ in sizes.needle], True
    kivi_model = None  # the Hugging Face model, loaded at the first reference row
    bar = tqdm(todo, desc=f"quality {model.name}", unit="setting")
    for name, setting in bar:
        bar.set_description(f"quality {model.name}: {name}")
        start = time.time()
        spec = reference_specs.get(setting) if isinstance(setting, str) else None
        try:
            if spec is not None:
                if ref is None:
                    raise RuntimeError("the reference rows compare with the 16-bit engine row, which failed")
                kivi_model = kivi_model or KiviModel(model.path, sizes.chunk)
                row, raw = evaluate_reference(kivi_model, spec, data, sizes, ref, bar), None
            else:
                with engine(model, setting, sizes, dtype, kv_bytes) as llm:
                    row, raw = evaluate(llm, setting, data, sizes, ref, needle_lengths, run_gsm8k, bar)
        except Exception as err:  # a setting vLLM or the plugin refuses: recorded, the others go on
            row, raw = {"error": error_text(err)}, None
        row = {"setting": name, **row, "seconds": round(time.time() - start, 1)}
        if setting == settings.BASELINE and raw is not None:
            ref = raw
            needle_lengths = [n for n in needle_lengths if row.get(f"needle_{n}", 0) > 0]
            run_gsm8k = row.get("gsm8k", 0) >= GSM8K_MIN
            result["gsm8k_note"] = gsm8k_note(row.get("gsm8k"), len(data.gsm8k), run_gsm8k)
        result["rows"].append(row)
        tqdm.write(f"{name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in row.items() if k != "setting"))
        report.write(out_dir, result, table(result))
    plot(result, out_dir / "quality.png")
    frontier(result, out_dir / "frontier.png")
    return result


def gsm8k_note(acc: float | None, n: int, ran: bool) -> str:
    if acc is None:
        return "GSM8K not run"
    if ran:
        return f"GSM8K: the uncompressed cache solves {acc:.0%} of {n} questions, so every setting was run"
    return (f"GSM8K: the uncompressed cache solves {acc:.0%} of the first {n} test questions (below "
            f"{GSM8K_MIN:.0%}), too close to zero to compare settings, so the compressed settings were not run")


def columns(result: dict) -> list[tuple[str, str]]:
    sizes = result["sizes"]
    cols = [("setting", "setting"), ("kv_vs_16bit", "KV vs 16-bit"), ("kv_tokens", "KV tokens")]
    cols += [(f"ppl_{c}", f"ppl @{c // 1024}k" if c >= 1024 else f"ppl @{c}") for c in sizes["contexts"]]
    cols += [("kl", "KL vs auto"), ("greedy_match", "greedy agree"), ("greedy_first_diff", "first diff")]
    cols += [(f"needle_{n}", f"needle @{n // 1024}k" if n >= 1024 else f"needle @{n}") for n, _ in sizes["needle"]]
    if any("gsm8k" in r for r in result["rows"][1:]):
        cols.append(("gsm8k", "GSM8K"))
    if any("humaneval" in r for r in result["rows"]):
        cols.append(("humaneval", "HumanEval pass@1"))
    return cols + [("error", "error")]


def table(result: dict) -> str:
    title = (f"## Quality: {result['model']} ({result['dtype']}), perplexity and greedy on {result['text']} "
             f"({result['text_source']}), needles on essays")
    note = result.get("gsm8k_note")
    return f"{title}\n\n" + report.markdown_table(result["rows"], columns(result)) + (f"\n\n{note}" if note else "")


def plot(result: dict, path) -> None:
    rows = [r for r in result["rows"] if "error" not in r]
    contexts = result["sizes"]["contexts"]
    lengths = [n for n, _ in result["sizes"]["needle"]]
    fig, (ax1, ax2, ax3) = report.figure(3, (13, 3.8))
    for r in rows:
        ax1.plot(contexts, [r[f"ppl_{c}"] for c in contexts], marker="o", label=r["setting"])
        got = [n for n in lengths if f"needle_{n}" in r]
        ax3.plot(got, [r[f"needle_{n}"] for n in got], marker="o", label=r["setting"])
    ax1.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="perplexity",
            title=f"perplexity ({result['text']})")
    ax1.set_xticks(contexts, [str(c) for c in contexts])
    ax1.minorticks_off()
    with_kl = [r for r in rows if "kl" in r]
    ax2.bar([r["setting"] for r in with_kl], [r["kl"] for r in with_kl], color="tab:gray")
    ax2.set(ylabel="mean KL (nats)", title="KL vs uncompressed", yscale="log")
    ax2.tick_params(axis="x", rotation=45)
    ax3.set(xscale="log", xlabel="prompt length (tokens)", ylabel="accuracy", title="needle retrieval",
            ylim=(-0.05, 1.05))
    ax3.set_xticks(lengths, [str(n) for n in lengths])
    ax3.minorticks_off()
    ax1.legend(fontsize=7)
    report.save_figure(fig, path, f"{result['model']} ({result['dtype']}), {result['device']}")
