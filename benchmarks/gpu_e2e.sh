#!/usr/bin/env bash
# On the GPU machine: `vllm bench throughput` on ShareGPT for each KV setting at one fixed KV
# memory (8 GiB), dummy weights of a well-known shape, vLLM's defaults (torch.compile, CUDA graphs).
# Settings: vLLM's own cache dtypes (auto, fp8, int4_per_token_head) or our configs (a preset
# name or a YAML path), each with ,VAR=VALUE for an environment of its own (gpu_common.sh, kv_flags:
# SETTINGS="quant-k4v4 quant-k4v4,KVCOMPRESS_DECODE=triton"). Logs and vLLM's JSON go to $OUT as
# SHAPE-SETTING.{log,json}.
#   SHAPE=llama2-7b TOKENIZER=dir DATA=sharegpt.json SETTINGS="auto fp8 quant-k4v4" bash benchmarks/gpu_e2e.sh
# TOKENIZER: a folder with a tokenizer and its config.json (benchmarks/dummy_models.py);
# DATA: ShareGPT as valid JSON (python -m benchmarks.sharegpt OUT --sample 2000), or that file
# xz-packed (benchmarks/pack_e2e_inputs.sh), unpacked to /tmp (gpu_common.sh).
# PROFILE=N: also record N engine steps after the first PROFILE_DELAY (default 300) with the torch
# profiler and print where the GPU time went (benchmarks/trace_summary.py), by kind of step too
# (PROFILE turns STEPS on: the step log marks the steps in the trace); tokens/s then suffer.
# Each run also prints its tokens/s as its requests complete (benchmarks/completion.py): the last
# 1% (the longest outputs, in a small batch) take about as long in every setting.
# A setting named twice runs twice (its second run's files end in -run2); the call ends with each
# setting's tokens/s and its ratio to the first setting's (benchmarks/e2e_ratios.py): SETTINGS="A B A"
# puts B between two runs of A.
# STEPS=1: also log every engine step (benchmarks/step_log) and print the run's time by kind of
# step (benchmarks/step_times.py); a setting's later runs are set against its first kind by kind,
# marked where they disagree.
# STACKS=N: also sample the engine process's host stacks for N seconds from its 64th step (py-spy,
# which must be installed: pip install py-spy) and print where its main thread's time went
# (benchmarks/host_stacks.py): steps that carry prompts launch every layer's attention from the host.
# STACKS turns STEPS on (the step log names the engine process).
# EXTRA_ARGS: more vLLM flags for every run, e.g. "--max-cudagraph-capture-size 2048".
# Long contexts: RANDOM_LENS="IN OUT" asks vLLM's random dataset for prompts of IN tokens and OUT
# output tokens each instead of ShareGPT, on a model whose positions are widened to MAX_MODEL_LEN
# (default 2048); KV_BYTES (default 8 GiB) sets the KV memory:
#   RANDOM_LENS="8000 500" MAX_MODEL_LEN=16000 NUM_PROMPTS=30 SETTINGS="quant-k4v4 auto" ...
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/results}; mkdir -p "$OUT"
[ -z "${PROFILE:-}" ] || STEPS=1
if [ -n "${STACKS:-}" ]; then
  STEPS=1
  command -v py-spy > /dev/null || { echo "STACKS=$STACKS: py-spy is not installed (pip install py-spy)"; exit 2; }
fi
[ -z "${RANDOM_LENS:-}" ] || POSITIONS=${MAX_MODEL_LEN:-2048}
source "$REPO/benchmarks/gpu_common.sh"

sample_stacks() {  # $1: the run's step-log prefix (its files end in the engine's pid), $2: the samples' file
  for _ in $(seq 1 1200); do
    for log in "$1".*; do
      [ -e "$log" ] || continue
      py-spy record -p "${log##*.}" -d "$STACKS" -r 250 --nonblocking -f raw -o "$2" > "$2.log" 2>&1
      return
    done
    sleep 0.5
  done
}
cd /tmp   # not the checkout: its triton_kernels/ folder would shadow the upstream package vLLM imports
read -ra extra <<< "${EXTRA_ARGS:-}"
dataset=(--dataset-name sharegpt --dataset-path "${DATA:-}")
if [ -n "${RANDOM_LENS:-}" ]; then
  read -r input_len output_len <<< "$RANDOM_LENS"
  dataset=(--dataset-name random --random-input-len "$input_len" --random-output-len "$output_len" --random-range-ratio 0)
fi
declare -A runs_of
results=()
for setting in $SETTINGS; do
  stop_stray_gpu_processes
  kv_flags "$setting"
  runs_of[$name]=$(( ${runs_of[$name]:-0} + 1 ))
  setting_name=$name
  [ "${runs_of[$name]}" = 1 ] || name="$name-run${runs_of[$name]}"
  prof=()
  if [ -n "${PROFILE:-}" ]; then
    rm -rf "$OUT/trace-$SHAPE-$name"
    prof=(--profile --profiler-config "{\"profiler\": \"torch\", \"torch_profiler_dir\": \"$OUT/trace-$SHAPE-$name\", \"torch_profiler_with_stack\": false, \"delay_iterations\": ${PROFILE_DELAY:-300}, \"max_iterations\": $PROFILE}")
  fi
  steps=()
  if [ -n "${STEPS:-}" ]; then
    rm -f "$OUT/steps-$SHAPE-$name".*
    steps=(env KVCOMPRESS_STEP_LOG="$OUT/steps-$SHAPE-$name" PYTHONPATH="$REPO/benchmarks/step_log${PYTHONPATH:+:$PYTHONPATH}")
  fi
  rm -f "$OUT/$SHAPE-$name.json"  # a failed run leaves none, not an earlier call's
  sampler=
  if [ -n "${STACKS:-}" ]; then
    rm -f "$OUT/stacks-$SHAPE-$name.txt"
    sample_stacks "$OUT/steps-$SHAPE-$name" "$OUT/stacks-$SHAPE-$name.txt" & sampler=$!
  fi
  start=$(date +%s)
  env "${run_env[@]}" "${steps[@]}" timeout "${RUN_TIMEOUT:-240}" python -m vllm.entrypoints.cli.main bench throughput --model "$MODEL" \
    --load-format dummy --dtype bfloat16 --max-model-len "${MAX_MODEL_LEN:-2048}" --kv-cache-memory-bytes "${KV_BYTES:-8589934592}" \
    "${dataset[@]}" --num-prompts "${NUM_PROMPTS:-1000}" --seed 0 \
    "${kv[@]}" "${extra[@]}" "${prof[@]}" --output-json "$OUT/$SHAPE-$name.json" > "$OUT/$SHAPE-$name.log" 2>&1
  echo "== $SHAPE $name rc=$? $(( $(date +%s) - start ))s: $(grep -hoE 'KV cache size: [0-9,]+ tokens|Throughput: .*' "$OUT/$SHAPE-$name.log" | tr '\n' ' ')"
  grep -E "Error|error:" "$OUT/$SHAPE-$name.log" | grep -v -i "warn" | tail -3
  python "$REPO/benchmarks/completion.py" "$OUT/$SHAPE-$name.log"  # tokens/s at 50/90/99/100% of requests done
  [ -z "${STEPS:-}" ] || python "$REPO/benchmarks/step_times.py" "$OUT/steps-$SHAPE-$name".*
  if [ -n "${STEPS:-}" ] && [ "${runs_of[$setting_name]}" -gt 1 ]; then  # this run against the setting's first
    first=("$OUT/steps-$SHAPE-$setting_name".*) this=("$OUT/steps-$SHAPE-$name".*)  # a log a process: the first
    [ -e "${first[0]}" ] && [ -e "${this[0]}" ] && python "$REPO/benchmarks/step_times.py" --compare "${first[0]}" "${this[0]}"
  fi
  [ -z "${PROFILE:-}" ] || python "$REPO/benchmarks/trace_summary.py" "$OUT/trace-$SHAPE-$name" --top 15
  if [ -n "$sampler" ]; then
    kill "$sampler" 2> /dev/null; wait "$sampler" 2> /dev/null
    if [ -s "$OUT/stacks-$SHAPE-$name.txt" ]; then
      python "$REPO/benchmarks/host_stacks.py" "$OUT/stacks-$SHAPE-$name.txt" \
        --under KVCompressImpl.forward --under KVCompressImpl._forward_salient
    else
      echo "no host stacks sampled: $(tail -2 "$OUT/stacks-$SHAPE-$name.txt.log" 2> /dev/null)"
    fi
  fi
  results+=("$setting_name=$OUT/$SHAPE-$name.json")
done
python "$REPO/benchmarks/e2e_ratios.py" "${results[@]}"
