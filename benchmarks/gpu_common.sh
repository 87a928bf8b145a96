# Sourced by the gpu_*.sh benchmark scripts: environment, the dummy model of $SHAPE, and how a KV
# setting becomes vLLM flags.
export VLLM_HOST_IP=127.0.0.1 PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
# vLLM finds the plugin through its entry point; without it our settings' flags are not even parsed
python -c "from importlib.metadata import entry_points as e; import sys
sys.exit(not any(p.value.startswith('vllm_kvcompress') for p in e(group='vllm.general_plugins')))" || {
  echo "vllm-kvcompress is not installed for $(command -v python): python -m pip install --no-deps -e . (docs/gpu.md)" >&2
  exit 1
}
# POSITIONS (optional): the model's positions, widened for long contexts
MODEL=${MODELS_DIR:-/tmp/models}/$SHAPE${POSITIONS:+-p$POSITIONS}
[ -f "$MODEL/config.json" ] || python "$REPO/benchmarks/dummy_models.py" "$SHAPE" "$TOKENIZER" "$MODEL" ${POSITIONS:-} >/dev/null
# DATA (ShareGPT, when a run reads it): valid JSON, or that file xz-packed (benchmarks/pack_e2e_inputs.sh),
# unpacked here to /tmp
case ${DATA:-} in *.xz) xz -dc "$DATA" > /tmp/sharegpt.json; DATA=/tmp/sharegpt.json ;; esac

# kv_flags SETTING[:BLOCK][,VAR=VALUE...]: sets kv (vLLM flags), run_env (VAR=VALUE words for this
# run's environment) and name (for file names). vLLM's own cache dtypes (auto, fp8,
# int4_per_token_head) or our configs (a preset name or a YAML path in the checkout); :BLOCK adds
# --block-size BLOCK (tokens a page), e.g. quant-k4v4:64; ,VAR=VALUE sets an environment variable
# for this run only, e.g. quant-k4v4,KVCOMPRESS_DECODE=triton (a before/after in one call).
kv_flags() {
  local spec=${1%%,*} assignments=""
  [ "$spec" = "$1" ] || assignments=${1#*,}
  IFS=, read -ra run_env <<< "$assignments"
  local setting=${spec%%:*} block=""
  [ "$setting" = "$spec" ] || block=${spec#*:}
  case $setting in
    auto|fp8|int4_per_token_head) kv=(--kv-cache-dtype "$setting") ;;
    *.yaml) kv=(--kv-compression "$REPO/$setting") ;;
    *) kv=(--kv-compression "$setting") ;;
  esac
  name=$(basename "$setting" .yaml)
  if [ -n "$block" ]; then kv+=(--block-size "$block"); name="$name-b$block"; fi
  local assignment
  for assignment in "${run_env[@]}"; do name="$name-${assignment//=/-}"; done
}

# stop_stray_gpu_processes: a run killed by its timeout can leave vLLM's engine process behind,
# holding its GPU memory, and the next run then fails to start ("Free memory on device ... is less
# than desired"). Before each run, on a GPU machine lent to these benchmarks alone, processes still
# on the GPU are stopped, and named.
stop_stray_gpu_processes() {
  local stray
  stray=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | tr '\n' ' ')
  if [ -n "${stray// /}" ]; then
    echo "stopping processes an earlier run left on the GPU: $stray"
    kill -9 $stray 2>/dev/null
    sleep 5
  fi
}
