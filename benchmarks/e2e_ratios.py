"""One call's `vllm bench throughput` runs compared: each setting's tokens/s over its runs, and each
setting against the first one.

Within one call a run's place moves its figure by up to 10% (docs/benchmarks.md), so a setting
compared with another is best run on both sides of it (``SETTINGS="A B A"``): the first setting's
runs are averaged geometrically and the spread between them is printed beside the ratios.

    python -m benchmarks.e2e_ratios NAME=RESULT.json [NAME=RESULT.json ...]    # in run order
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import geometric_mean


def tokens_per_s(result: Path) -> float | None:
    """The run's tokens/s from vLLM's --output-json (None: the run wrote none, e.g. it failed)."""
    try:
        return float(json.loads(result.read_text())["tokens_per_second"])
    except (OSError, ValueError, KeyError):
        return None


def summary(runs: list[tuple[str, float | None]]) -> list[str]:
    """Lines for the (setting, tokens/s) runs in order: each setting's runs and their geometric mean,
    then every other setting against the first one's."""
    by_setting: dict[str, list[float | None]] = {}
    for name, rate in runs:
        by_setting.setdefault(name, []).append(rate)
    done = {name: [r for r in rates if r is not None] for name, rates in by_setting.items()}
    lines = []
    for name, rates in by_setting.items():
        shown = " / ".join("failed" if r is None else f"{r:,.0f}" for r in rates)
        mean = f" (geometric mean {geometric_mean(done[name]):,.0f})" if len(done[name]) > 1 else ""
        lines.append(f"{name}: {shown} tokens/s{mean}")
    base, *others = done
    if not done[base]:
        return lines
    reference = geometric_mean(done[base])
    spread = f"; {base}'s runs {max(done[base]) / min(done[base]) - 1:.1%} apart" if len(done[base]) > 1 else ""
    lines += [f"{name} / {base}: {geometric_mean(done[name]) / reference:.3f}x{spread}" for name in others if done[name]]
    return lines


def main(argv: list[str]) -> int:
    runs = []
    for arg in argv:
        name, sep, path = arg.partition("=")
        if not sep:
            print(f"e2e_ratios: expected NAME=RESULT.json, got {arg!r}", file=sys.stderr)
            return 2
        runs.append((name, tokens_per_s(Path(path))))
    if runs:
        print("\n".join(summary(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
