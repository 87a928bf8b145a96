# Sourced by the gpu_*.sh benchmark scripts: environment, the dummy model of $SHAPE, and how a KV
# setting becomes vLLM flags.
export VLLM_HOST_IP=127.0.0.1 PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
# vLLM finds the plugin through its entry point; without it our settings' flags are not even parsed
python -c "from importlib.metadata import entry_points as e; import sys
sys.exit(not any(p.value.startswith('vllm_kvcompress') for p in e(group='vllm.general_plugins')))" || {
  echo "vllm-kvcompress is not installed for $(command -v python): python -m pip install --no-deps -e . (docs/gpu.md)" >&2
  exit 1
}
MODEL=${MODELS_DIR:-/tmp/models}/$SHAPE
[ -f "$MODEL/config.json" ] || python "$REPO/benchmarks/dummy_models.py" "$SHAPE" "$TOKENIZER" "$MODEL" >/dev/null

# kv_flags SETTING: sets kv (vLLM flags) and name (for file names). vLLM's own cache dtypes (auto,
# fp8, int4_per_token_head) or our configs (a preset name or a YAML path in the checkout).
kv_flags() {
  case $1 in
    auto|fp8|int4_per_token_head) kv=(--kv-cache-dtype "$1") ;;
    *.yaml) kv=(--kv-compression "$REPO/$1") ;;
    *) kv=(--kv-compression "$1") ;;
  esac
  name=$(basename "$1" .yaml)
}
