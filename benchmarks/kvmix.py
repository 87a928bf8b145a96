"""KVmix's comparison on real weights: does the profiled choice of high-bit layers beat uniform
2 bits, and a random choice of the same number of high-bit K and V layers (same average bits)?
Each with and without the recent full-precision window (RPC), by perplexity on held-out essays
from the engine's prompt logprobs.

The variants are built from the profiled config with the profiler's own ``build_config`` (the
same layout ``kvcompress profile --rpc-tokens N`` writes); random baselines draw, per seed, as many
high-bit K layers and V layers as the profile chose, independently.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from . import quality, report, settings
from .models import Model


def _bits(config: dict, which: str) -> list[int]:
    n = config["model"]["num_layers"]
    default = config["default"][f"{which}_bits"]
    return [config.get("layers", {}).get(i, {}).get(f"{which}_bits", default) for i in range(n)]


def variants(config: dict, seeds: list[int], rpc_tokens: int) -> list[tuple[str, str, dict]]:
    """(kind, name, config dict) for profiled, uniform 2-bit and one random choice per seed; with
    ``rpc_tokens`` > 0 each also with the recent window."""
    from vllm_kvcompress.tools.profiler import LOW_BITS, Plan, build_config

    k, v = _bits(config, "k"), _bits(config, "v")
    n = len(k)
    k_high, v_high = [i for i, b in enumerate(k) if b != LOW_BITS], [i for i, b in enumerate(v) if b != LOW_BITS]
    high_k, high_v = max(k), max(v)
    plans = [("profiled", "profiled", k, v), ("uniform", "uniform 2-bit", [LOW_BITS] * n, [LOW_BITS] * n)]
    for seed in seeds:
        rng = random.Random(seed)
        rk, rv = set(rng.sample(range(n), len(k_high))), set(rng.sample(range(n), len(v_high)))
        plans.append(("random", f"random (seed {seed})", [high_k if i in rk else LOW_BITS for i in range(n)],
                      [high_v if i in rv else LOW_BITS for i in range(n)]))
    out = []
    for rpc in ([0, rpc_tokens] if rpc_tokens > 0 else [0]):
        for kind, name, kb, vb in plans:
            label = f"{name} + RPC {rpc}" if rpc else name
            cfg = build_config(Plan(kb, vb, [], [], len(k_high)), f"kvmix-{kind}", label, config["model"], rpc)
            out.append((kind, label, cfg))
    return out


def avg_bits(cfg: dict) -> float:
    """Mean of K and V code bits over layers (the recent window's 16-bit copies not counted)."""
    k, v = _bits(cfg, "k"), _bits(cfg, "v")
    return (sum(k) + sum(v)) / (len(k) + len(v))


def run(model: Model, config_path: Path, seeds: list[int], rpc_tokens: int, sizes: quality.Sizes, out_dir: Path,
        dtype: str, kv_bytes: int) -> dict:
    import yaml
    from transformers import AutoTokenizer

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    config = yaml.safe_load(Path(config_path).read_text())
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    windows = quality.prepare_data(tokenizer, sizes).windows
    ctx = max(sizes.contexts)
    result = {"bench": "kvmix", "model": model.name, "config": str(config_path), "seeds": seeds,
              "rpc_tokens": rpc_tokens, "windows": len(windows), "window_tokens": ctx - 1, "dtype": dtype,
              "device": report.device(), "rows": []}
    todo = [("reference", settings.label(settings.BASELINE), settings.BASELINE), *variants(config, seeds, rpc_tokens)]
    bar = tqdm(todo, desc="kvmix", unit="config")
    for kind, label, cfg in bar:
        bar.set_postfix_str(label)
        start = time.time()
        try:
            with quality.engine(model, cfg, sizes, dtype, kv_bytes) as llm:
                logprobs = [lp for lp, _ in quality.window_logprobs(llm, windows, 1)]
                row = {"kv_tokens": quality.kv_tokens(llm), "ppl": quality.perplexity_at(logprobs, ctx)}
        except Exception as err:
            row = {"error": quality.error_text(err)}
        if kind == "reference":
            row |= {"rpc_tokens": 0, "avg_bits": 16.0}
        else:
            row |= {"rpc_tokens": cfg["default"].get("rpc_tokens", 0), "avg_bits": avg_bits(cfg)}
        row = {"kind": kind, "setting": label, **row, "seconds": round(time.time() - start, 1)}
        result["rows"].append(row)
        tqdm.write(f"{label}: {row.get('ppl', row.get('error'))}")
        report.write(out_dir, result, table(result))
    plot(result, out_dir / "kvmix.png")
    return result


def summary(result: dict) -> list[dict]:
    """Per RPC setting: profiled, uniform, and the random choices' mean, spread and range."""
    out = []
    for rpc in sorted({r["rpc_tokens"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["rpc_tokens"] == rpc and "ppl" in r and r["kind"] != "reference"]
        rand = [r["ppl"] for r in rows if r["kind"] == "random"]
        prof = next((r["ppl"] for r in rows if r["kind"] == "profiled"), None)
        uni = next((r["ppl"] for r in rows if r["kind"] == "uniform"), None)
        ref = next((r["ppl"] for r in result["rows"] if r["kind"] == "reference" and "ppl" in r), None)
        row = {"rpc": f"{rpc} tokens" if rpc else "off", "reference": ref, "profiled": prof, "uniform": uni}
        if rand:
            row |= {"random_mean": statistics.mean(rand), "random_sd": statistics.stdev(rand) if len(rand) > 1 else 0.0,
                    "random_min": min(rand), "random_max": max(rand), "random_n": len(rand),
                    "random_beaten": sum(prof is not None and prof < x for x in rand)}
        out.append(row)
    return out


SUMMARY_COLUMNS = [("rpc", "recent window"), ("reference", "16-bit"), ("profiled", "profiled"),
                   ("uniform", "uniform 2-bit"),
                   ("random_mean", "random: mean"), ("random_sd", "random: sd"), ("random_min", "random: best"),
                   ("random_max", "random: worst"), ("random_beaten", "random draws worse than profiled"),
                   ("random_n", "random draws")]
COLUMNS = [("setting", "setting"), ("avg_bits", "avg K/V bits"), ("kv_tokens", "KV tokens"), ("ppl", "perplexity"),
           ("error", "error")]


def table(result: dict) -> str:
    return (report.markdown_table(summary(result), SUMMARY_COLUMNS) + "\n\n" +
            report.markdown_table(result["rows"], COLUMNS))


def plot(result: dict, path: Path) -> None:
    """Perplexity of each choice of high-bit layers, without and with the recent window."""
    groups = summary(result)
    fig, ax = report.figure(1, (6, 3.6))
    width = 0.8 / len(groups)
    for g, group in enumerate(groups):
        rpc = 0 if group["rpc"] == "off" else int(group["rpc"].split()[0])
        rows = [r for r in result["rows"] if r["rpc_tokens"] == rpc and "ppl" in r]
        for x, kind in enumerate(("profiled", "random", "uniform")):
            vals = [r["ppl"] for r in rows if r["kind"] == kind]
            if not vals:
                continue
            pos = x + (g - (len(groups) - 1) / 2) * width
            ax.bar(pos, statistics.mean(vals), width, color=f"C{g}", alpha=0.6,
                   label=f"recent window {group['rpc']}" if x == 0 else None)
            ax.scatter([pos] * len(vals), vals, color="black", s=10, zorder=3)
    if groups and groups[0]["reference"] is not None:
        ax.axhline(groups[0]["reference"], color="black", linestyle=":", label="16-bit cache")
    ax.set_xticks(range(3), ["profiled", "random (same bits)", "uniform 2-bit"])
    ax.set(ylabel="perplexity (essays)", title=f"KVmix high-bit layers, {result['model']}")
    ax.legend(fontsize=8)
    report.save_figure(fig, path)
