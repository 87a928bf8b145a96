"""CUDA-graph capture sizes for the larger batches that compressed pages hold.

vLLM captures CUDA graphs for batches of up to 512 tokens by default (1024 on data-centre
Blackwell) and runs larger ones eagerly: on a 7B model, a batch of 513 to 2,048 tokens then takes
about 27 ms whatever its size, against 15 ms for a captured 500 (docs/benchmarks.md). Compressed
pages hold 3 to 4 times the requests, so a decode batch (about 145 rows in a 4/4 run) plus a prompt
chunk passes 512 tokens in most steps that carry prompts. Where the engine left its capture sizes
to vLLM, the plugin adds sizes past vLLM's largest: every 64 tokens up to 1,024, every 128 up to
2,048, none past the scheduler's token budget (which is itself captured where it lies below 2,048).
Given sizes (``--cudagraph-capture-sizes``, ``--max-cudagraph-capture-size`` or the same fields
of ``--compilation-config``) are left as they are.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

CEILING = 2048       # tokens: past this a step is bound by its matrix products, not by the host
_FROM = 512          # vLLM's default ceiling; a smaller largest size means a small max_num_seqs
_GRID = list(range(_FROM + 64, 1024 + 1, 64)) + list(range(1024 + 128, CEILING + 1, 128))

_left_to_vllm: ContextVar[bool] = ContextVar("kvcompress_capture_sizes_left_to_vllm", default=False)


def sizes_given(engine_args) -> bool:
    """Whether the engine's arguments choose capture sizes (the flags or the compilation config)."""
    cc = engine_args.compilation_config
    fields = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")
    given = [cc.get(f) if isinstance(cc, dict) else getattr(cc, f, None) for f in fields]
    return any(v is not None for v in given + [getattr(engine_args, f, None) for f in fields])


@contextlib.contextmanager
def building(engine_args):
    """Around the build of an engine's config: lets ``extend`` know whether the sizes were given."""
    token = _left_to_vllm.set(not sizes_given(engine_args))
    try:
        yield
    finally:
        _left_to_vllm.reset(token)


def added_sizes(sizes: list[int], max_batched_tokens: int) -> list[int]:
    """The sizes to add to vLLM's ``sizes`` (ascending): none where its largest is under 512."""
    if not sizes or sizes[-1] < _FROM:
        return []
    top, budget = sizes[-1], min(max_batched_tokens, CEILING)
    extra = [s for s in _GRID if top < s <= budget]
    if top < budget and budget not in extra:
        extra.append(budget)
    return extra


def extend(vllm_config) -> list[int]:
    """Adds ``added_sizes`` to the config's capture sizes where the engine being built left them
    to vLLM (inside ``building``); returns what it added."""
    if not _left_to_vllm.get():
        return []
    cc = vllm_config.compilation_config
    extra = added_sizes(cc.cudagraph_capture_sizes or [], vllm_config.scheduler_config.max_num_batched_tokens)
    if extra:
        cc.cudagraph_capture_sizes = sorted(cc.cudagraph_capture_sizes + extra)
        cc.max_cudagraph_capture_size = cc.cudagraph_capture_sizes[-1]
    return extra
