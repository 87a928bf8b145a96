"""``vllm bench serve`` against our OpenAI-compatible server, per KV setting, at a sweep of
request rates: TTFT and TPOT percentiles (ShareGPT prompts)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

from . import report, settings
from .models import Model
from .proc import env, run_logged

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot")
COLUMNS = [("setting", "setting"), ("rate", "request rate (/s)"), ("request_throughput", "requests/s"),
           ("output_throughput", "output tokens/s"),
           *[(f"p{p}_{m}_ms", f"{m.upper()} p{p} (ms)") for m in METRICS for p in PERCENTILES], ("error", "error")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``vllm serve`` (the plugin loads in it) on a free local port, stopped with SIGTERM."""

    def __init__(self, model: Model, setting: str, log: Path, kv_bytes: int, max_model_len: int, eager: bool):
        self.port, self.log = _free_port(), log
        cmd = settings.vllm_command(
            "serve", model.path, *model.engine_args, "--host", "127.0.0.1", "--port", self.port,
            "--kv-cache-memory-bytes", kv_bytes, "--max-model-len", max_model_len,
            *(["--enforce-eager"] if eager else []), *settings.cli_args(setting))
        server_env = env()
        server_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the API server needs its engine in its own process
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=server_env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> str | None:
        """None once /health answers; otherwise why not (the log's error line)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                return report.error_line(self.log.read_text(errors="replace"))
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return None
            except OSError:
                time.sleep(1)
        return f"server did not answer /health within {timeout:.0f} s"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def bench(server: Server, model: Model, dataset: Path, rate: float, num_prompts: int, output_len: int | None,
          out_dir: Path, name: str, timeout: float) -> dict:
    result = out_dir / "logs" / f"serve-{name}-rate{rate:g}.json"
    cmd = settings.vllm_command(
        "bench", "serve", "--backend", "openai", "--base-url", server.url, "--model", model.path,
        "--tokenizer", model.path, "--dataset-name", "sharegpt", "--dataset-path", dataset,
        "--num-prompts", num_prompts, "--request-rate", rate, "--seed", 0, "--disable-tqdm",
        *(["--sharegpt-output-len", output_len] if output_len else []),
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
        "--save-result", "--result-dir", result.parent, "--result-filename", result.name)
    rc, log = run_logged(cmd, result.with_suffix(".log"), timeout)
    if rc != 0 or not result.exists():
        return {"error": report.error_line(log)}
    return summary(json.loads(result.read_text()))


def summary(data: dict) -> dict:
    """The figures kept from one ``vllm bench serve --save-result`` file."""
    keep = ["completed", "request_throughput", "output_throughput",
            *[f"{s}_{m}_ms" for m in METRICS for s in ("mean", *(f"p{p}" for p in PERCENTILES))]]
    return {k: data[k] for k in keep if k in data}


def run(model: Model, kv_settings: list[str], rates: list[float], dataset: Path, out_dir: Path, num_prompts: int,
        kv_bytes: int, max_model_len: int, output_len: int | None, eager: bool, timeout: float) -> list[dict]:
    rows = []
    bar = tqdm(total=len(kv_settings) * len(rates), desc="serve", unit="run")
    for setting in kv_settings:
        name = settings.label(setting).replace(" ", "_")
        bar.set_postfix_str(f"{setting}: starting server")
        server = Server(model, setting, out_dir / "logs" / f"server-{name}.log", kv_bytes, max_model_len, eager)
        try:
            refused = server.wait_ready(timeout)
            for rate in rates:
                bar.set_postfix_str(f"{setting} at {rate:g}/s")
                row = {"setting": setting, "rate": rate}
                row.update({"error": refused} if refused else
                           bench(server, model, dataset, rate, num_prompts, output_len, out_dir, name, timeout))
                rows.append(row)
                tqdm.write(f"{setting} rate {rate:g}: " + ", ".join(
                    f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                    if k not in ("setting", "rate")))
                bar.update()
        finally:
            server.stop()
    bar.close()
    return rows


def table(rows: list[dict]) -> str:
    return report.markdown_table(rows, COLUMNS)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """TTFT and TPOT (median, p99) against the request rate, one line per setting."""
    fig, axes = report.figure(2, (10, 3.6))
    for setting in dict.fromkeys(r["setting"] for r in rows):
        got = [r for r in rows if r["setting"] == setting and "p50_ttft_ms" in r]
        for ax, metric in zip(axes, METRICS):
            line, = ax.plot([r["rate"] for r in got], [r[f"p50_{metric}_ms"] for r in got], marker="o",
                            label=f"{settings.label(setting)} p50")
            ax.plot([r["rate"] for r in got], [r[f"p99_{metric}_ms"] for r in got], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{settings.label(setting)} p99")
    for ax, metric in zip(axes, METRICS):
        ax.set(xlabel="request rate (/s)", ylabel=f"{metric.upper()} (ms)", title=metric.upper(), yscale="log")
    axes[0].legend(fontsize=7)
    report.save_figure(fig, path, title)
