"""Where a profiled run spent its GPU time: GPU kernels of torch-profiler traces, grouped by name.

    python benchmarks/trace_summary.py TRACE_DIR_OR_FILE [--top 25]

Reads the Chrome traces vLLM's torch profiler writes (``*.json`` or ``*.json.gz``), sums the
duration of every GPU kernel by name (kernels replayed from CUDA graphs included) and prints the
share of each, with the wall span the kernels cover, so idle GPU time shows too.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

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
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path", type=Path)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    for trace in _traces(args.path):
        kernels = _events(trace)
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


if __name__ == "__main__":
    main()
