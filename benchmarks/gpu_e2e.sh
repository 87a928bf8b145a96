#!/usr/bin/env bash
# On the GPU machine: `vllm bench throughput` on ShareGPT for each KV setting at one fixed KV
# memory (8 GiB), dummy weights of MODEL's shape, vLLM's defaults (torch.compile, CUDA graphs).
# Settings: vLLM's own cache dtypes (auto, fp8, int4_per_token_head) or our configs (a preset
# name or a YAML path). Logs and vLLM's JSON go to $OUT as TAG-SETTING.{log,json}.
#   MODEL=dir DATA=sharegpt.json TAG=llama2-7b SETTINGS="auto fp8 quant-k4v4" bash benchmarks/gpu_e2e.sh
set -uo pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"
export VLLM_HOST_IP=127.0.0.1 PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
for setting in $SETTINGS; do
  case $setting in
    auto|fp8|int4_per_token_head) kv=(--kv-cache-dtype "$setting") ;;
    *) kv=(--kv-compression "$setting") ;;
  esac
  name=$(basename "$setting" .yaml)
  start=$(date +%s)
  timeout "${RUN_TIMEOUT:-420}" python -m vllm.entrypoints.cli.main bench throughput --model "$MODEL" \
    --load-format dummy --dtype bfloat16 --max-model-len 2048 --kv-cache-memory-bytes 8589934592 \
    --dataset-name sharegpt --dataset-path "$DATA" --num-prompts "${NUM_PROMPTS:-1000}" --seed 0 \
    "${kv[@]}" --output-json "$OUT/$TAG-$name.json" > "$OUT/$TAG-$name.log" 2>&1
  echo "== $TAG $name rc=$? $(( $(date +%s) - start ))s: $(grep -hoE 'KV cache size: [0-9,]+ tokens|Throughput: .*' "$OUT/$TAG-$name.log" | tr '\n' ' ')"
  grep -E "Error|error:" "$OUT/$TAG-$name.log" | grep -v -i "warn" | tail -3
done
