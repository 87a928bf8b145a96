"""``vllm bench throughput`` on ShareGPT, one run per KV setting at one fixed KV memory.

Collects requests/s and tokens/s (vLLM's ``Throughput:`` line) and the KV capacity in
tokens that vLLM logs at startup (``GPU KV cache size: N tokens``, ``CPU ...`` on CPU).
"""

from __future__ import annotations

import re
from pathlib import Path

from tqdm import tqdm

from . import report, settings
from .models import Model
from .proc import run_logged

CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")
THROUGHPUT = re.compile(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s")
COLUMNS = [("setting", "setting"), ("kv_tokens", "KV tokens"), ("kv_vs_auto", "KV vs auto"),
           ("requests_per_s", "requests/s"), ("tokens_per_s", "tokens/s"), ("output_tokens_per_s", "output tokens/s"),
           ("error", "error")]


def parse_log(log: str) -> dict:
    row = {}
    if m := CAPACITY.search(log):
        row["kv_tokens"] = int(m.group(1).replace(",", ""))
    if m := THROUGHPUT.search(log):
        row["requests_per_s"], row["tokens_per_s"], row["output_tokens_per_s"] = map(float, m.groups())
    return row


def run(model: Model, kv_settings: list[str], dataset: Path, out_dir: Path, num_prompts: int, kv_bytes: int,
        max_model_len: int, output_len: int | None, eager: bool, timeout: float) -> list[dict]:
    rows = []
    bar = tqdm(kv_settings, desc="throughput", unit="setting")
    for setting in bar:
        bar.set_postfix_str(setting)
        name = settings.label(setting).replace(" ", "_")
        cmd = settings.vllm_command(
            "bench", "throughput", "--model", model.path, *model.engine_args, "--dataset-name", "sharegpt",
            "--dataset-path", dataset, "--num-prompts", num_prompts, "--seed", 0,
            "--kv-cache-memory-bytes", kv_bytes, "--max-model-len", max_model_len,
            *(["--output-len", output_len] if output_len else []), *(["--enforce-eager"] if eager else []),
            *settings.cli_args(setting), "--output-json", out_dir / "logs" / f"throughput-{name}.json")
        rc, log = run_logged(cmd, out_dir / "logs" / f"throughput-{name}.log", timeout)
        row = {"setting": setting, **parse_log(log)}
        if rc != 0 or "tokens_per_s" not in row:
            row["error"] = report.error_line(log)
        rows.append(row)
        tqdm.write(f"{setting}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k != "setting"))
    base = next((r.get("kv_tokens") for r in rows if r["setting"] == settings.BASELINE), None)
    for r in rows:
        if base and r.get("kv_tokens"):
            r["kv_vs_auto"] = r["kv_tokens"] / base
    return rows


def table(rows: list[dict]) -> str:
    return report.markdown_table(rows, COLUMNS)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Output tokens/s and KV capacity per setting, side by side."""
    names = [settings.label(r["setting"]) for r in rows]
    fig, (ax1, ax2) = report.figure(2, (10, 3.6))
    ax1.bar(names, [r.get("output_tokens_per_s", 0) for r in rows], color="tab:blue")
    ax1.set(ylabel="output tokens/s", title="throughput (vllm bench throughput)")
    ax2.bar(names, [r.get("kv_tokens", 0) for r in rows], color="tab:green")
    ax2.set(ylabel="KV tokens", title="KV capacity at the same memory")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=45)
    for ax, key in ((ax1, "output_tokens_per_s"), (ax2, "kv_tokens")):
        for i, r in enumerate(rows):
            if key not in r:
                ax.text(i, 0, "failed", ha="center", va="bottom", fontsize=7, rotation=90)
    report.save_figure(fig, path, title)
