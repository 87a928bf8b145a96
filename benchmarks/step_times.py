"""Where a `vllm bench throughput` run's time goes, by kind of engine step, from the step log that
``benchmarks/step_log`` writes (``gpu_e2e.sh`` with ``STEPS=1``).

A step's time is the interval from its metadata build to the next one on the host. With vLLM's
asynchronous scheduling the host prepares a step while the GPU runs the one before, so over many
steps these intervals add up to the run's time, while a single one may hold part of its
neighbour's. The run starts at the first step of 1,024 tokens or more, after a step of one
request, after which the number of requests climbs: the engine starts with dummy batches (of any
size), captures CUDA graphs (dummy batches of a fixed request count) and warms up on single
requests; the benchmark then hands all its prompts over at once.

    python -m benchmarks.step_times STEPLOG.PID [...]     # a table per log
    python -m benchmarks.step_times --compare FIRST.PID SECOND.PID   # two runs of one setting

Two runs of one setting should agree kind by kind; where a kind's median moved by more than
``MOVED`` the second run is marked, and a ratio taken against it is suspect (such moves have
hit whole runs' steps with prompts while their decode steps held).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from statistics import median

FIRST_STEP_TOKENS = 1024
MOVED = 0.15  # a kind's median that moves more between two runs of one setting marks the pair


@dataclass(frozen=True)
class Step:
    seconds: float       # until the next step's build
    decodes: int         # requests with one new token
    prompt_tokens: int   # tokens of the other requests (0: a decode-only step, padding aside)

    @property
    def tokens(self) -> int:
        return self.decodes + self.prompt_tokens


def steps(text: str) -> list[Step]:
    """The run's steps from a step log (``host_time requests decodes padding tokens`` a line)."""
    rows = [[float(x) for x in line.split()] for line in text.splitlines() if line.strip()]
    single = next((i for i, r in enumerate(rows) if r[1] == 1), 0)
    start = next((i for i in range(single, len(rows) - 1)
                  if rows[i][4] >= FIRST_STEP_TOKENS and rows[i + 1][1] > rows[i][1]), 0)
    rows = rows[start:]
    return [step(nxt[0] - t, *counts) for (t, *counts), nxt in zip(rows, rows[1:])]


def step(seconds: float, requests: float, decodes: float, padding: float, tokens: float) -> Step:
    """A step from its log line's counts."""
    prompt = 0 if requests - padding == decodes else int(tokens - decodes)
    return Step(seconds, int(decodes), prompt)


KINDS = (  # name, test
    ("decode, under 20 rows", lambda s: not s.prompt_tokens and s.decodes < 20),
    ("decode, 20 to 119 rows", lambda s: not s.prompt_tokens and 20 <= s.decodes < 120),
    ("decode, 120 rows or more", lambda s: not s.prompt_tokens and s.decodes >= 120),
    # by the batch's tokens, decode rows included, which decide whether a step replays CUDA graphs
    # (vLLM captures batches of up to 512 tokens by default)
    ("mixed, batch up to 512 tokens", lambda s: s.prompt_tokens and s.tokens <= 512),
    ("mixed, batch 513 to 2,048 tokens", lambda s: s.prompt_tokens and 512 < s.tokens <= 2048),
    ("mixed, batch over 2,048 tokens", lambda s: s.prompt_tokens and s.tokens > 2048),
)


def kind_of(s: Step) -> str:
    return next(name for name, test in KINDS if test(s))


def table(run: list[Step]) -> str:
    total = sum(s.seconds for s in run)
    lines = [f"{len(run)} steps, {total:.2f} s",
             f"{'kind':34s} {'steps':>6s} {'s':>7s} {'share':>6s} {'median ms':>10s} {'decode rows':>12s} {'prompt tokens':>14s}"]
    for name, test in KINDS:
        kind = [s for s in run if test(s)]
        if not kind:
            continue
        seconds = sum(s.seconds for s in kind)
        lines.append(f"{name:34s} {len(kind):6d} {seconds:7.2f} {seconds / total:6.1%} "
                     f"{median(s.seconds for s in kind) * 1e3:10.2f} {sum(s.decodes for s in kind) / len(kind):12.0f} "
                     f"{sum(s.prompt_tokens for s in kind) / len(kind):14.0f}")
    return "\n".join(lines)


def compare(first: list[Step], second: list[Step]) -> list[str]:
    """Each kind both runs have: its median step in each and the move, marked where past ``MOVED``."""
    lines = []
    for name, test in KINDS:
        a, b = [median(s.seconds for s in run if test(s)) if any(test(s) for s in run) else None
                for run in (first, second)]
        if a is None or b is None:
            continue
        move = b / a - 1
        lines.append(f"{name:34s} {a * 1e3:8.2f} -> {b * 1e3:8.2f} ms {move:+7.1%}"
                     + ("  moved: runs disagree" if abs(move) > MOVED else ""))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--compare", action="store_true", help="two logs: runs of one setting, kind by kind")
    args = ap.parse_args()
    if args.compare:
        first, second = args.logs
        print(f"{first.name} -> {second.name}, median step by kind:")
        print("\n".join(compare(steps(first.read_text()), steps(second.read_text()))))
        return
    for path in args.logs:
        print(f"{path.name}: {table(steps(path.read_text()))}")


if __name__ == "__main__":
    main()
