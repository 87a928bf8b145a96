"""Tokens/s of a `vllm bench throughput` run as its requests complete, from the log's progress bar.

The bar reports, at each completion, the elapsed time and the prompt and output tokens of the
requests completed so far per second. A run's last requests (the longest outputs, decoding in a
small batch) take about as long in every KV setting, so the whole run's tokens/s hides how the
settings compare while the batch is full; the rate at 99% of requests shows it.

    python -m benchmarks.completion LOG [LOG ...]     # a line per log: 50/90/99/100% completion
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

_BAR = re.compile(r"Processed prompts:[^\r\n]*?\|\s*(\d+)/(\d+) \[(?:(\d+):)?(\d+):(\d+)<[^\r\n]*?"
                  r"input: ([\d.]+) toks/s, output: ([\d.]+) toks/s")


@dataclass(frozen=True)
class Completion:
    done: int          # requests completed
    total: int
    seconds: int       # elapsed, as the bar shows it (whole seconds)
    tokens_per_s: float  # prompt and output tokens of the completed requests, per elapsed second


def progress(log: str) -> list[Completion]:
    """The bar's updates in order (the carriage returns between them read as line ends)."""
    points = []
    for m in _BAR.finditer(log.replace("\r", "\n")):
        hours, minutes, seconds = int(m[3] or 0), int(m[4]), int(m[5])
        points.append(Completion(int(m[1]), int(m[2]), 3600 * hours + 60 * minutes + seconds,
                                 float(m[6]) + float(m[7])))
    return points


def at_fraction(points: list[Completion], fraction: float) -> Completion | None:
    """The first update with at least ``fraction`` of the requests completed (None: the bar never
    gets there, a run stopped by its time limit)."""
    return next((p for p in points if p.done >= fraction * p.total), None)


def summary(log: str, fractions=(0.5, 0.9, 0.99, 1.0)) -> str:
    """The rate at each fraction the run reached; a run cut short ends on its last update, so that
    settings stopped by one time limit still compare at a fraction they all reached."""
    points = progress(log)
    if not points:
        raise ValueError("no progress bar of `vllm bench throughput` in the log")
    reached = [(f, p) for f, p in ((f, at_fraction(points, f)) for f in fractions) if p is not None]
    parts = [f"{f:.0%} done at {p.seconds} s: {p.tokens_per_s:,.0f} tokens/s" for f, p in reached]
    last = points[-1]
    if last.done < last.total:
        parts.append(f"stopped at {last.done}/{last.total} ({last.seconds} s): {last.tokens_per_s:,.0f} tokens/s")
    return "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path)
    for path in ap.parse_args().logs:
        try:
            print(f"{path.name}: {summary(path.read_text(errors='replace'))}")
        except ValueError as err:  # a run that failed before its first request completed
            print(f"{path.name}: {err}")


if __name__ == "__main__":
    main()
