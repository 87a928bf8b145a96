"""With ``KVCOMPRESS_STEP_LOG=PREFIX`` set, every process that imports an attention backend's
metadata builder (ours, or vLLM's FlashAttention for `auto` and `fp8`) appends a line per build, one
build an engine step: ``host_time requests decodes padding tokens`` to ``PREFIX.PID``.
``decodes``: requests with one query token; ``padding``: requests with none (a full CUDA graph's
batch padded to a captured size); ``tokens``: the step's tokens, padding included. Under the torch
profiler each build is also a range named ``kvcompress step: requests decodes padding tokens``,
where ``trace_summary.py`` cuts a trace into steps (vLLM's model runner marks none).

Put this folder on ``PYTHONPATH`` (``gpu_e2e.sh`` does with ``STEPS=1``); it stands in for any
other ``sitecustomize`` on the path. ``python -m benchmarks.step_times`` reads the files.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import time

_PREFIX = os.environ.get("KVCOMPRESS_STEP_LOG")
_BUILDERS = {"vllm_kvcompress.backend": "KVCompressMetadataBuilder",
             "vllm.v1.attention.backends.flash_attn": "FlashAttentionMetadataBuilder"}
_lines: list[str] = []


def _flush() -> None:
    if _lines:
        with open(f"{_PREFIX}.{os.getpid()}", "a") as f:
            f.write("".join(_lines))
        _lines.clear()


def _logged(builder: type) -> None:
    build = builder.build

    def logged_build(self, *args, **kwargs):
        cam = kwargs.get("common_attn_metadata") or args[1]
        starts = cam.query_start_loc_cpu[: cam.num_reqs + 1]
        q_lens = starts[1:] - starts[:-1]
        counts = f"{cam.num_reqs} {int((q_lens == 1).sum())} {int((q_lens == 0).sum())} {cam.num_actual_tokens}"
        _lines.append(f"{time.perf_counter():.6f} {counts}\n")
        if len(_lines) >= 64:
            _flush()
        import torch

        with torch.profiler.record_function("kvcompress step: " + counts):
            return build(self, *args, **kwargs)

    builder.build = logged_build


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps a builder's ``build`` once its module has run."""

    def find_spec(self, name, path, target=None):
        if name not in _BUILDERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _logged(getattr(module, _BUILDERS[name]))

        spec.loader.exec_module = exec_and_wrap
        return spec


if _PREFIX:
    import atexit

    sys.meta_path.insert(0, _AfterImport())
    atexit.register(_flush)
