"""Quality metrics computed from what the vLLM engine returns (prompt logprobs, generated tokens).

Kept free of vLLM imports so they can be checked against independent computations.
"""

from __future__ import annotations

import math
import re

TopK = dict[int, float]  # token id -> logprob, the top entries vLLM returns for one position


def prompt_token_logprobs(prompt_ids: list[int], prompt_logprobs: list) -> list[float]:
    """Log-probability of each prompt token from the 2nd on given its prefix (vLLM's ``prompt_logprobs``
    always holds the actual token next to the top-k; the first position is ``None``)."""
    return [prompt_logprobs[i][t].logprob for i, t in enumerate(prompt_ids) if i > 0]


def top_k(prompt_logprobs: list) -> list[TopK]:
    """Per position (from the 2nd token on): {token: logprob} of what vLLM returned."""
    return [{t: lp.logprob for t, lp in pos.items()} for pos in prompt_logprobs[1:]]


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def kl_top_k(ref: TopK, test: TopK, k: int) -> tuple[float, bool]:
    """KL(ref || test) over the reference's ``k`` most likely tokens plus one bucket for the rest.

    This is the KL of both distributions coarsened to those k+1 outcomes, a lower bound of the full
    KL. A reference token missing from ``test`` (outside what the engine returned) is given the
    smallest logprob ``test`` holds, an upper bound of its probability. Returns (KL, whether any
    token was missing)."""
    top = sorted(ref.items(), key=lambda kv: -kv[1])[:k]
    floor = min(test.values())
    missing = any(t not in test for t, _ in top)
    p = [math.exp(lp) for _, lp in top]
    q = [math.exp(test.get(t, floor)) for t, _ in top]
    kl = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)
    p_rest, q_rest = max(0.0, 1 - sum(p)), max(1e-12, 1 - sum(q))
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return kl, missing


def greedy_agreement(ref: list[int], test: list[int]) -> tuple[float, int]:
    """(share of positions where the tokens are equal, index of the first difference or the length)."""
    n = min(len(ref), len(test))
    same = [a == b for a, b in zip(ref[:n], test[:n])]
    first = same.index(False) if False in same else n
    return sum(same) / max(1, len(ref)), first


def last_number(text: str) -> str | None:
    """The last number in a text, without thousands separators (GSM8K answers)."""
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return found[-1].replace(",", "").rstrip(".") if found else None
