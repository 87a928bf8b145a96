"""Where a profiled run spent its GPU time: GPU kernels of torch-profiler traces, grouped by name.

    python benchmarks/trace_summary.py TRACE_DIR_OR_FILE [--top 25]

Reads the Chrome traces vLLM's torch profiler writes (``*.json`` or ``*.json.gz``), sums the
duration of every GPU kernel by name (kernels replayed from CUDA graphs included) and prints the
share of each, with the wall span the kernels cover, so idle GPU time shows too. Then engine steps
by kind as ``step_times.py`` sorts them, where the run logged its steps (``STEPS=1``, the ranges
``step_log`` marks): the time from one step's start to the next, the GPU time of the kernels the
step launched, by group, and the host's time in vLLM's attention ops, each a median over the
kind's steps; a step whose GPU time falls short of its interval waited on the host.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path
from statistics import median

if __package__:
    from .step_times import kind_of, step
else:  # run by its path
    from step_times import kind_of, step

# names of our kernels and of the parts of a step they belong to, for the summary lines
GROUPS = {  # first match wins: ZipCache's write before the cache writes' needles
    "ZipCache write: probe scores, re-compression (ours)": ("salient_write",),
    "decode attention (ours)": ("_decode_kernel", "decode_mha", "decode_gqa", "merge_splits", "_slim_decode",
                                "salient_decode", "_own_token"),
    "prompt history read (ours)": ("_history_kernel",),
    "cache write (ours)": ("_write_kernel", "write_kernel<"),
    "attention (vLLM)": ("flash", "fmha", "attn"),
    "matmul": ("gemm", "sm90_xmma", "cutlass", "nvjet", "ampere_", "matmul"),
}


def _traces(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.name.endswith((".json", ".json.gz")))


def _events(trace: Path) -> list[dict]:
    opener = gzip.open if trace.name.endswith(".gz") else open
    with opener(trace, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def _kernels(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("cat") == "kernel"]


STEP = "kvcompress step: "  # step_log's range at each step's start: requests decodes padding tokens
ATTENTION_OPS = ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update")  # vLLM's, into a backend
LAUNCHES = ("cuda_runtime", "cuda_driver")  # launches by the runtime (graphs too) and the driver (Triton's)


def group_of(name: str) -> str:
    low = name.lower()
    for group, needles in GROUPS.items():
        if any(n.lower() in low for n in needles):
            return group
    return "other"


def summarize(kernels: list[dict]) -> dict:
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        entry = by_name[e["name"]]
        entry[0] += float(e["dur"])
        entry[1] += 1
    busy = sum(v[0] for v in by_name.values())
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels) if kernels else 0.0
    groups: dict[str, float] = defaultdict(float)
    for name, (us, _) in by_name.items():
        groups[group_of(name)] += us
    return {"busy_us": busy, "span_us": span, "kernels": by_name, "groups": dict(groups)}


def steps(events: list[dict]) -> dict[str, list[dict]]:
    """Engine steps by kind (``step_times.kind_of``), each a dict of its ``rows`` (decodes and
    prompts, padding aside), ``interval_us`` from its start to the next step's (the last step has no
    next and is left out), the ``gpu_us`` of the kernels launched in between (matched by the
    launches' correlation ids, graph replays included) and their ``groups``, and
    ``host_attention_us``, the host's time in vLLM's attention ops (the backend's, where no graph
    replays them)."""
    starts = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(STEP)),
                    key=lambda e: e["ts"])
    launches = sorted((e for e in events if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})),
                      key=lambda e: e["ts"])
    attention_ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e["name"] in ATTENTION_OPS),
                           key=lambda e: e["ts"])
    kernels_of = defaultdict(list)
    for k in _kernels(events):
        kernels_of[k.get("args", {}).get("correlation")].append(k)
    by_kind: dict[str, list[dict]] = defaultdict(list)
    i = a = 0
    for start, after in zip(starts, starts[1:]):
        requests, decodes, padding, tokens = map(int, start["name"][len(STEP):].split())
        while i < len(launches) and launches[i]["ts"] < start["ts"]:
            i += 1
        groups: dict[str, float] = defaultdict(float)
        while i < len(launches) and launches[i]["ts"] < after["ts"]:
            for k in kernels_of.get(launches[i]["args"]["correlation"], ()):
                groups[group_of(k["name"])] += float(k["dur"])
            i += 1
        while a < len(attention_ops) and attention_ops[a]["ts"] < start["ts"]:
            a += 1
        host_attention = 0.0
        while a < len(attention_ops) and attention_ops[a]["ts"] < after["ts"]:
            host_attention += float(attention_ops[a]["dur"])
            a += 1
        by_kind[kind_of(step(0.0, requests, decodes, padding, tokens))].append(
            {"rows": requests - padding, "interval_us": after["ts"] - start["ts"], "gpu_us": sum(groups.values()),
             "groups": dict(groups), "host_attention_us": host_attention})
    return dict(by_kind)


def print_steps(by_kind: dict[str, list[dict]]) -> None:
    for kind, rows in by_kind.items():
        med = {key: median([r[key] for r in rows]) for key in ("rows", "interval_us", "gpu_us", "host_attention_us")}
        print(f"   {len(rows)} steps {kind}, median {med['rows']:.0f} rows; ms: start to start "
              f"{med['interval_us'] / 1e3:.2f}, GPU {med['gpu_us'] / 1e3:.2f}, host in attention ops "
              f"{med['host_attention_us'] / 1e3:.2f}")
        names = sorted({g for r in rows for g in r["groups"]}, key=lambda g: -sum(r["groups"].get(g, 0) for r in rows))
        for g in names:
            print(f"      {g:50s} {median([r['groups'].get(g, 0.0) for r in rows]) / 1e3:7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path", type=Path)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    for trace in _traces(args.path):
        events = _events(trace)
        kernels = _kernels(events)
        if not kernels:
            continue
        s = summarize(kernels)
        print(f"== {trace.name}: {len(kernels)} kernels, busy {s['busy_us'] / 1e3:.1f} ms of a "
              f"{s['span_us'] / 1e3:.1f} ms span ({100 * s['busy_us'] / max(s['span_us'], 1e-9):.0f}%)")
        for group, us in sorted(s["groups"].items(), key=lambda kv: -kv[1]):
            print(f"   {group:28s} {us / 1e3:9.2f} ms {100 * us / s['busy_us']:5.1f}%")
        rows = sorted(s["kernels"].items(), key=lambda kv: -kv[1][0])[: args.top]
        for name, (us, n) in rows:
            print(f"   {us / 1e3:9.2f} ms {100 * us / s['busy_us']:5.1f}% {n:6d}x {us / n:8.1f} us  {name[:90]}")
        print_steps(steps(events))


if __name__ == "__main__":
    main()
