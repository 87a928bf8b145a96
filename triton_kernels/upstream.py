"""What a top-level ``import triton_kernels`` gets where the checkout's root is on ``sys.path``: the
upstream package of that name from elsewhere on the path, else vLLM's bundled copy (as vLLM itself
falls back), else ``ModuleNotFoundError``, as without the checkout."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

NAME = "triton_kernels"
_CHECKOUT_ROOT = Path(__file__).resolve().parent.parent


def _elsewhere() -> list[str]:
    return [p for p in sys.path if Path(p or ".").resolve() != _CHECKOUT_ROOT]


def hand_over() -> None:
    """Replace this module in ``sys.modules`` with the package the importer meant."""
    del sys.modules[NAME]
    spec = importlib.machinery.PathFinder.find_spec(NAME, _elsewhere())
    if spec is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = module
        spec.loader.exec_module(module)
        return
    if importlib.util.find_spec("vllm.third_party.triton_kernels") is not None:
        sys.modules[NAME] = importlib.import_module("vllm.third_party.triton_kernels")
        return
    raise ModuleNotFoundError(f"No module named {NAME!r}", name=NAME)
