"""On a machine with two GPUs: every parallel layout against one GPU, for each KV setting.

A small trained Llama (4 query heads, 2 KV heads, 4 layers; tests/tiny_models.py) runs once on
one GPU and then with tensor parallelism 2 and pipeline parallelism 2, each through vLLM's
``mp`` and ``ray`` executors. Greedy tokens must equal the one-GPU run of the same setting, and
the KV tokens vLLM reports are printed beside one GPU's (under TP each rank holds half the KV
heads, under PP half the layers, so the same memory a GPU holds about twice the tokens). The
per-layer setting gives layers 0 and 3 other bits than 1 and 2, so a rank that numbered its
layers from 0 would pick the wrong page format. Each run is its own process (a fresh engine,
as a user starts one).

    PYTHONPATH=tests python benchmarks/gpu_parallel.py --out results/parallel
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = {
    "1-GPU": {},
    "TP2-mp": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    "TP2-ray": {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"},
    "PP2-mp": {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"},
    "PP2-ray": {"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"},
}
PER_LAYER = "default: {k_bits: 4, v_bits: 4}\nlayers:\n  0: {k_bits: 8, v_bits: 8}\n  3: {k_bits: 2, v_bits: 2}\n"
KV_BYTES = 256 << 20  # a GPU


def settings(out: Path) -> dict[str, tuple[str | None, list[str]]]:
    """Each setting and the layouts it runs in (the per-layer bits matter most under PP)."""
    per_layer = out / "per-layer.yaml"
    per_layer.write_text(PER_LAYER)
    return {"16-bit": (None, list(LAYOUTS)), "quant-k4v4": ("quant-k4v4", list(LAYOUTS)),
            "per-layer": (str(per_layer), ["1-GPU", "TP2-mp", "PP2-mp", "PP2-ray"])}


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def one_run(model: str, layout: str, setting: str | None, dtype: str, out_file: Path) -> None:
    """In its own process: greedy tokens and KV capacity of one (layout, setting)."""
    from engine_utils import engine, greedy, kv_capacity_tokens, prose

    prompts = [prose(30 + 41 * i, seed=i) for i in range(8)]
    start = time.time()
    with engine(model, setting, dtype=dtype, kv_bytes=KV_BYTES, **LAYOUTS[layout]) as llm:
        out_file.write_text(json.dumps({"tokens": greedy(llm, prompts, 48), "kv_tokens": kv_capacity_tokens(llm),
                                        "seconds": round(time.time() - start, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, help="folder for the model, logs and parallel.json")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    ap.add_argument("--settings", nargs="+", default=["16-bit", "quant-k4v4", "per-layer"])
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/kvc-parallel-llama"))
    ap.add_argument("--timeout", type=int, default=180, help="seconds a run")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--one", nargs=4, metavar=("MODEL", "LAYOUT", "SETTING", "OUT_FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        model, layout, setting, out_file = args.one
        one_run(model, layout, None if setting == "-" else setting, args.dtype, Path(out_file))
        return
    if args.out is None:
        ap.error("--out is required")
    from importlib.metadata import entry_points
    if not any(p.value.startswith("vllm_kvcompress") for p in entry_points(group="vllm.general_plugins")):
        sys.exit("vllm-kvcompress is not installed for this Python: vLLM would ignore the settings (docs/gpu.md)")

    from tiny_models import build_llama

    args.out.mkdir(parents=True, exist_ok=True)
    model = str(build_llama(args.model_dir, num_kv_heads=2, num_heads=4))
    results: dict[str, dict[str, dict]] = {}
    for name, (setting, layouts) in settings(args.out).items():
        if name not in args.settings:
            continue
        for layout in ["1-GPU"] + [x for x in args.layouts if x != "1-GPU" and x in layouts]:
            out_file = args.out / f"{name}-{layout}.json"
            log = out_file.with_suffix(".log")
            cmd = [sys.executable, __file__, "--dtype", args.dtype, "--one", model, layout, setting or "-", str(out_file)]
            try:
                with open(log, "w") as f:
                    rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, check=False,
                                        env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0")).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc == 0:
                results.setdefault(name, {})[layout] = json.loads(out_file.read_text())
                log.unlink()
                out_file.unlink()
            else:
                tail = log.read_text().splitlines()[-8:]
                results.setdefault(name, {})[layout] = {"error": f"rc={rc}", "log_tail": tail}
            r = results[name][layout]
            base = results[name].get("1-GPU", {})
            if "tokens" in r and "tokens" in base:
                same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
                r["greedy_equal"] = f"{same}/{len(base['tokens'])}"
                r["same_first_tokens"] = [common_prefix(a, b) for a, b in zip(r["tokens"], base["tokens"])]
                r["kv_ratio"] = round(r["kv_tokens"] / base["kv_tokens"], 3)
            print(f"{name:10s} {layout:8s} " + json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
    (args.out / f"parallel-{'-'.join(args.settings)}.json").write_text(json.dumps(results, indent=1))
    failed = [f"{n} {lay}" for n, rows in results.items() for lay, r in rows.items()
              if "error" in r or r.get("greedy_equal", "8/8") != "8/8"]
    print("all layouts equal one GPU" if not failed else f"differ or failed: {failed}")


if __name__ == "__main__":
    main()
