"""HumanEval pass@1 of the quality benchmark (``benchmarks/humaneval.py``): the code taken from a
model's answer, the program made of it, and its score by OpenAI's harness on the real problems."""

import dataclasses

import pytest

from benchmarks import humaneval, quality
from benchmarks.__main__ import _parser, _quality_sizes, main

PROBLEMS = {p["task_id"]: p for p in humaneval.problems()}
HAS_CLOSE = PROBLEMS["HumanEval/0"]  # from typing import List, then has_close_elements
PALINDROME = PROBLEMS["HumanEval/10"]  # is_palindrome (given), then make_palindrome
FULL_HAS_CLOSE = """def has_close_elements(numbers: List[float], threshold: float) -> bool:
    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])"""


def test_the_problems_are_humaneval_in_file_order():
    assert len(PROBLEMS) == 164 and [p["task_id"] for p in humaneval.problems(3)] == [f"HumanEval/{i}"
                                                                                    for i in range(3)]


# --- the code of an answer -------------------------------------------------------------------


def test_extract_code_takes_the_first_fenced_block():
    answer = "Here it is:\n\n```python\n\ndef f():\n    return 1\n```\nand a test:\n```python\nf()\n```\n"
    assert humaneval.extract_code(answer) == "def f():\n    return 1"
    assert humaneval.extract_code("```\n    return 2\n```") == "    return 2"  # bare fence; a body keeps its indent
    assert humaneval.extract_code("```py\nx = 1\n```") == "x = 1"
    assert humaneval.extract_code("Sure.\n```python\ndef f():\n    return [") == "def f():\n    return ["  # cut off


def test_extract_code_without_a_fence_is_the_whole_answer():
    assert humaneval.extract_code("\n    return 3\n\n") == "    return 3"
    assert humaneval.extract_code("def f():\n    return 1\n") == "def f():\n    return 1"


def test_a_body_follows_the_whole_prompt_cut_where_the_function_ends():
    body = "    return False\n\n\ndef main():\n    print(1)\n"  # a continuation runs on past the function
    assert humaneval.program(HAS_CLOSE, body) == HAS_CLOSE["prompt"] + "    return False\n"


def test_a_whole_function_follows_the_prompt_up_to_its_function():
    assert humaneval.program(HAS_CLOSE, FULL_HAS_CLOSE) == "from typing import List\n\n\n" + FULL_HAS_CLOSE + "\n"
    source = humaneval.program(PALINDROME, "def make_palindrome(string: str) -> str:\n    return string")
    assert "def is_palindrome" in source and source.count("def make_palindrome") == 1


# --- scoring with the harness ----------------------------------------------------------------


@pytest.mark.parametrize("task", ["HumanEval/0", "HumanEval/10", "HumanEval/38"])
def test_the_canonical_solution_passes_and_a_wrong_one_fails(task):
    problem = PROBLEMS[task]
    assert humaneval.passes(problem, humaneval.program(problem, problem["canonical_solution"]))
    assert not humaneval.passes(problem, humaneval.program(problem, "    return None\n"))


def test_a_whole_function_passes_with_the_imports_and_helpers_it_leaves_out():
    assert humaneval.passes(HAS_CLOSE, humaneval.program(HAS_CLOSE, FULL_HAS_CLOSE))  # List comes from the prompt
    assert not humaneval.passes(HAS_CLOSE, FULL_HAS_CLOSE)  # alone, List is not defined
    body = PALINDROME["canonical_solution"]  # calls is_palindrome, which the prompt defines
    whole = "def make_palindrome(string: str) -> str:\n" + body
    assert humaneval.passes(PALINDROME, humaneval.program(PALINDROME, whole))


def test_pass_at_1_is_the_share_of_answers_that_pass():
    problems = [HAS_CLOSE, PALINDROME, PROBLEMS["HumanEval/2"]]
    answers = [f"Here you go:\n```python\n{FULL_HAS_CLOSE}\n```\nIt compares every pair.",
               PALINDROME["canonical_solution"] + "\nThat is the shortest palindrome.\n",  # prose after the body
               "```python\ndef truncate_number(number: float) -> float:\n    return number\n```"]
    assert humaneval.pass_at_1(problems, answers) == pytest.approx(2 / 3)


# --- prompts and the quality benchmark's use -------------------------------------------------


def test_prompts_ask_to_complete_the_function_in_the_chat_template(tmp_path):
    from tiny_models import build_tokenizer

    tok = build_tokenizer(tmp_path)
    (ids, problem), _ = humaneval.prompts(tok, 2)
    assert problem == HAS_CLOSE
    want = "user: Complete the following Python function:\n```python\n" + HAS_CLOSE["prompt"].strip() + "\n```\n"
    assert tok.decode(ids) == want + "assistant: "
    tok.chat_template = None  # a base model continues the bare prompt
    assert tok.decode(humaneval.prompts(tok, 1)[0][0]) == HAS_CLOSE["prompt"]
    assert humaneval.prompts(tok, 0) == []


def test_the_engine_leaves_room_for_the_prompts_and_answers():
    small = dataclasses.replace(quality.SMALL, humaneval=2)
    assert quality.SMALL.max_len == 512 and small.max_len == humaneval.PROMPT_ROOM + small.humaneval_tokens > 512
    assert quality.FULL.max_len == dataclasses.replace(quality.FULL, humaneval=164).max_len == 8192


def test_the_column_is_on_the_table():
    result = {"model": "m", "dtype": "float32", "text": "essays", "text_source": "essays",
              "sizes": dataclasses.asdict(quality.SMALL),
              "rows": [{"setting": "16-bit (auto)", "humaneval": 0.5}, {"setting": "quant-k4v4", "humaneval": 0.25}]}
    assert ("humaneval", "HumanEval pass@1") in quality.columns(result)
    assert "HumanEval pass@1" in quality.table(result)
    result["rows"] = [{"setting": "16-bit (auto)"}]
    assert "humaneval" not in dict(quality.columns(result))


@pytest.mark.parametrize("count", ["165", "-1"])
def test_humaneval_option_is_checked_before_anything_runs(count, capsys):
    with pytest.raises(SystemExit, match=rf"^error: --humaneval {count} is not allowed; allowed: 0 to 164$"):
        main(["quality", "--humaneval", count, "--model", "no-such-model"])


def test_humaneval_option_reaches_the_sizes():
    assert _quality_sizes(_parser().parse_args(["quality"])).humaneval == 0
    sizes = _quality_sizes(_parser().parse_args(["quality", "--humaneval", "5"]))
    assert (sizes.humaneval, sizes.humaneval_tokens) == (5, 512)
    sizes = _quality_sizes(_parser().parse_args(["quality", "--small", "--humaneval", "164"]))
    assert (sizes.humaneval, sizes.humaneval_tokens) == (164, 64)
