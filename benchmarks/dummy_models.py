"""Model folders of well-known shapes for speed runs with ``--load-format dummy``.

vLLM makes up the weights; the folder holds only ``config.json`` and a tokenizer.
No Llama tokenizer is available offline, so the folders borrow SmolLM2's (a real
byte-level BPE of 49,152 tokens; Llama-2's has 32,000) and size the vocabulary to it.

    python -m benchmarks.dummy_models llama2-7b TOKENIZER_DIR OUT_DIR [POSITIONS]

POSITIONS widens the shape's positions (its rotary table) for long-context runs.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

SHAPES = {
    # multi-head attention: 32 query and 32 KV heads
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, max_position_embeddings=4096, rope_theta=10000.0),
    # grouped-query attention: 32 query heads share 8 KV heads
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
    # multi-head attention: 40 query and 40 KV heads (the tensor-parallel table)
    "llama2-13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                       num_key_value_heads=40, max_position_embeddings=4096, rope_theta=10000.0),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_dummy_model(shape: str, tokenizer_dir: Path, out_dir: Path, positions: int | None = None) -> Path:
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2, **SHAPES[shape]}
    if positions:
        config["max_position_embeddings"] = max(positions, config["max_position_embeddings"])
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5) or sys.argv[1] not in SHAPES:
        sys.exit(f"usage: python -m benchmarks.dummy_models {'|'.join(SHAPES)} TOKENIZER_DIR OUT_DIR [POSITIONS]")
    print(write_dummy_model(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]),
                            int(sys.argv[4]) if len(sys.argv) == 5 else None))
