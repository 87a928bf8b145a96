"""Where the engine's host time goes, from py-spy's raw samples of the engine process
(``py-spy record --nonblocking -f raw``; ``gpu_e2e.sh``'s STACKS records them during each run).

Steps that carry prompts run the model outside full CUDA graphs: the host launches every layer's
attention, and where it takes longer than the GPU's work the GPU waits. This prints, for the
engine's main thread (its stacks through ``_process_engine_step``), the seconds spent in each part
of a step (a frame and all it calls) and, with ``--under``, what a function's time went to, line by
line of its own code. A launch that waits for room in the GPU's queue counts as host time too: where
the GPU is the bottleneck, launches look slow; read these beside the GPU's busy time (``PROFILE``).

    python benchmarks/host_stacks.py stacks-llama2-7b-zipcache-r60.txt --rate 250
    python benchmarks/host_stacks.py stacks.txt --under KVCompressImpl._forward_salient
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

ENGINE_STEP = "_process_engine_step"  # vLLM's engine loop: a frame of the main thread's every step
PARTS = {  # a part of a step: a frame (its name as py-spy prints it, without the file)
    "model forward (all layers)": "LlamaModel.forward",
    "attention (ours)": "KVCompressImpl.forward",
    "cache update (ours)": "KVCompressImpl.do_kv_cache_update",
    "metadata (ours)": "KVCompressMetadataBuilder.build",
    "scheduler": "Scheduler.schedule",
    "sampling": "sample_tokens",
}


def samples(text: str) -> list[tuple[list[str], int]]:
    """py-spy's raw lines (``frame;frame;... count``, outermost first) as (frames, count)."""
    out = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
    return out


def function(frame: str) -> str:
    """``name (file:line)`` -> ``name``."""
    return frame.split(" (", 1)[0]


def is_frame_of(frame: str, name: str) -> bool:
    """Whether ``frame`` (``Class.method (file:line)``) is function ``name`` (``method``, ``Class.method``)."""
    found = function(frame)
    return found == name or found.endswith("." + name)


def engine_steps(stacks: list[tuple[list[str], int]]) -> list[tuple[list[str], int]]:
    return [(frames, n) for frames, n in stacks if any(is_frame_of(f, f"EngineCoreProc.{ENGINE_STEP}") for f in frames)]


def parts(stacks: list[tuple[list[str], int]]) -> Counter:
    """Samples by part of a step (``PARTS``), each counting a sample once."""
    out = Counter()
    for frames, n in stacks:
        for part, name in PARTS.items():
            if any(is_frame_of(f, name) for f in frames):
                out[part] += n
    return out


def under(stacks: list[tuple[list[str], int]], name: str) -> Counter:
    """Samples in function ``name`` (its innermost call) by the frame it called next, or by its own
    line (``(self) name (file:line)``) where the sample was in that line itself."""
    out = Counter()
    for frames, n in stacks:
        at = [i for i, f in enumerate(frames) if is_frame_of(f, name)]
        if at:
            i = at[-1]
            out[frames[i + 1] if i + 1 < len(frames) else f"(self) {frames[i]}"] += n
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stacks", type=Path, nargs="+")
    p.add_argument("--rate", type=float, default=250.0, help="py-spy's samples a second (its -r)")
    p.add_argument("--under", action="append", default=[],
                   help="also break a function's time down by what it called (repeatable)")
    args = p.parse_args()
    for path in args.stacks:
        steps = engine_steps(samples(path.read_text()))
        total = sum(n for _, n in steps)
        print(f"{path.name}: engine main thread busy {total / args.rate:.2f} s")
        for part, n in parts(steps).most_common():
            print(f"  {part:28s} {n / args.rate:6.2f} s {100 * n / max(total, 1):5.1f}%")
        for name in args.under:
            inside = under(steps, name)
            if inside:
                print(f"  in {name}: {sum(inside.values()) / args.rate:.2f} s")
                for frame, n in inside.most_common(12):
                    print(f"    {n / args.rate:6.3f} s  {frame}")


if __name__ == "__main__":
    main()
