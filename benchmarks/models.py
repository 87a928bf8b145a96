"""Models the benchmarks run: real weights from pip packages (converted once into a
Hugging Face folder), dummy-weight folders of well-known shapes, or any model folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .dummy_models import SHAPES, write_dummy_model

REAL = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m",  # short name -> folder
        "qwen-coder": "qwen2.5-coder-0.5b-instruct"}


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    engine_args: list[str] = field(default_factory=list)  # e.g. --load-format dummy


def prepare(name: str, models_dir: Path) -> Model:
    """``name``: smollm2, gemma3, qwen-coder (converted from their GGUF packages), a dummy shape
    (llama2-7b, llama3-8b: vLLM makes up the weights), or a model folder."""
    from vllm_kvcompress.tools.gguf_to_hf import convert_named

    models_dir = Path(models_dir)
    if name in REAL:
        out = models_dir / REAL[name]
        if not (out / "config.json").exists():
            print(f"converting {name} to {out} (once)", flush=True)
            convert_named(name, out)
        return Model(name, out)
    if name in SHAPES:
        tokenizer = prepare("smollm2", models_dir).path
        return Model(name, write_dummy_model(name, tokenizer, models_dir / f"dummy-{name}"),
                     ["--load-format", "dummy"])
    path = Path(name)
    if not (path / "config.json").exists():
        raise SystemExit(f"model {name!r}: not one of {', '.join([*REAL, *SHAPES])} and not a model folder")
    return Model(path.name, path)
