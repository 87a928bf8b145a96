#!/usr/bin/env bash
# On the GPU machine: `vllm bench serve` against `vllm serve` (OpenAI API) for each KV setting at a
# sweep of request rates, dummy weights of a well-known shape, 8 GiB of KV, vLLM's defaults.
# Each setting leaves three files in $OUT (few, as a GPU machine may hand back few): the server's
# log, serve-SHAPE-SETTING.log (the warm-up's and every rate's `vllm bench serve` output) and
# serve-SHAPE-SETTING.jsonl (one saved result a line, in the order of RATES; read a line with
# benchmarks.serve.summary).
#   SHAPE=llama2-7b TOKENIZER=dir DATA=sharegpt.json SETTINGS="auto quant-k4v4" RATES="4 16" bash benchmarks/gpu_serve.sh
# Each server first answers WARMUP (default 32) prompts at once, not measured. DATA may be xz-packed
# (gpu_common.sh).
# SERVE: the server command (default `vllm serve` through its module; `python -m vllm_kvcompress.cli serve`
# is the plugin's own front end).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/results}; mkdir -p "$OUT"
PORT=${PORT:-8123}
source "$REPO/benchmarks/gpu_common.sh"
cd /tmp   # not the checkout: its triton_kernels/ folder would shadow the upstream package vLLM imports
for setting in $SETTINGS; do
  stop_stray_gpu_processes
  kv_flags "$setting"
  env "${run_env[@]}" ${SERVE:-python -m vllm.entrypoints.cli.main serve} "$MODEL" --port "$PORT" --load-format dummy --dtype bfloat16 \
    --max-model-len 2048 --kv-cache-memory-bytes 8589934592 "${kv[@]}" > "$OUT/server-$SHAPE-$name.log" 2>&1 &
  server=$!
  for _ in $(seq 1 "${START_TIMEOUT:-180}"); do
    python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health')" 2>/dev/null && break
    kill -0 $server 2>/dev/null || break
    sleep 1
  done
  bench=(python -m vllm.entrypoints.cli.main bench serve --backend openai --base-url "http://127.0.0.1:$PORT"
         --model "$MODEL" --tokenizer "$MODEL" --dataset-name sharegpt --dataset-path "$DATA" --disable-tqdm)
  log="$OUT/serve-$SHAPE-$name.log"; results="$OUT/serve-$SHAPE-$name.jsonl"; scratch=$(mktemp -d)
  echo "== warm-up" > "$log"
  timeout 120 "${bench[@]}" --num-prompts "${WARMUP:-32}" --request-rate inf --seed 1 >> "$log" 2>&1
  for rate in $RATES; do
    start=$(date +%s)
    echo "== rate $rate" > "$scratch/rate.log"
    timeout "${RUN_TIMEOUT:-150}" "${bench[@]}" --num-prompts "${NUM_PROMPTS:-200}" --request-rate "$rate" --seed 0 \
      --percentile-metrics ttft,tpot --metric-percentiles 50,90,99 --save-result --result-dir "$scratch" \
      --result-filename result.json >> "$scratch/rate.log" 2>&1
    rc=$?
    cat "$scratch/rate.log" >> "$log"
    [ -f "$scratch/result.json" ] && { tr -d '\n' < "$scratch/result.json"; echo; } >> "$results" && rm "$scratch/result.json"
    echo "== $SHAPE $name rate $rate rc=$rc $(( $(date +%s) - start ))s: $(grep -hE 'Request throughput|Median TTFT|P99 TTFT|Median TPOT|P99 TPOT' "$scratch/rate.log" | tr -s ' ' | tr '\n' ';')"
  done
  rm -rf "$scratch"
  kill $server; wait $server 2>/dev/null; pkill -f "entrypoints.cli.main serve"; sleep 3
  grep -E "kv-compression|KV cache size" "$OUT/server-$SHAPE-$name.log" | head -2 | cut -c1-200 || true  # a log line, if any
done
