"""KV settings as the benchmarks name them: vLLM's own cache dtypes, or our configs.

``auto`` is vLLM's 16-bit cache (the baseline); ``fp8`` and ``int4_per_token_head`` are
vLLM's ``--kv-cache-dtype`` values; anything else is a ``--kv-compression`` config (a
preset name or a YAML path).
"""

from __future__ import annotations

import sys
from pathlib import Path

VLLM_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int4_per_token_head")
BASELINE = "auto"
VLLM_CLI = Path(__file__).resolve().parent / "vllm_cli.py"


def cli_args(setting: str) -> list[str]:
    if setting in VLLM_CACHE_DTYPES:
        return ["--kv-cache-dtype", setting]
    return ["--kv-compression", setting]


def llm_kwargs(setting: str) -> dict:
    """Keyword arguments of ``vllm.LLM`` for a setting."""
    if setting in VLLM_CACHE_DTYPES:
        return {"kv_cache_dtype": setting}
    return {"additional_config": {"kv_compression": setting}}


def label(setting: str) -> str:
    return "16-bit (auto)" if setting == BASELINE else Path(setting).stem if setting.endswith(".yaml") else setting


def vllm_command(*args) -> list[str]:
    return [sys.executable, str(VLLM_CLI), *map(str, args)]


def on_gpu() -> bool:
    import torch
    return torch.cuda.is_available()
