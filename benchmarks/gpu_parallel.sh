#!/usr/bin/env bash
# On a two-GPU machine, vLLM installed (benchmarks/gpu_install.sh, docs/gpu.md): the multi-GPU check
# and the tensor-parallel throughput table.
#   RAY_WHEELS=dir STAGE=check bash benchmarks/gpu_parallel.sh
#       every parallel layout (TP2, PP2; mp and ray) against one GPU (benchmarks/gpu_parallel.py)
#   STAGE=tp1|tp2 TOKENIZER=dir DATA=sharegpt.json.xz bash benchmarks/gpu_parallel.sh
#       `vllm bench throughput` on ShareGPT, Llama-2-13B shape, 8 GiB of KV a GPU, auto, fp8 and
#       quant-k4v4, on one GPU (tp1) or with --tensor-parallel-size 2 (tp2) (benchmarks/gpu_e2e.sh)
# RAY_WHEELS: a folder of the ray extra's wheels for this Python (ray, jsonschema and its needs),
# installed into /tmp/raysite; the GPU machine has no network. Logs go to $OUT.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/results}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 RAY_USAGE_STATS_ENABLED=0
if [ -n "${RAY_WHEELS:-}" ]; then
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/raysite "$RAY_WHEELS"/*.whl || exit 1
fi
[ -d /tmp/raysite ] && export PYTHONPATH=/tmp/raysite${PYTHONPATH:+:$PYTHONPATH}
case ${STAGE:-check} in
  check)
    cd /tmp && PYTHONPATH="$REPO/tests:$PYTHONPATH" python "$REPO/benchmarks/gpu_parallel.py" --out "$OUT/parallel" \
      ${CHECK_ARGS:-}
    ;;
  tp1|tp2)
    tp=${STAGE#tp}
    OUT="$OUT/tp$tp" SHAPE=llama2-13b SETTINGS=${SETTINGS:-"auto fp8 quant-k4v4"} NUM_PROMPTS=${NUM_PROMPTS:-500} \
      RUN_TIMEOUT=${RUN_TIMEOUT:-180} EXTRA_ARGS="--tensor-parallel-size $tp" bash "$REPO/benchmarks/gpu_e2e.sh"
    ;;
  *) echo "STAGE: check, tp1 or tp2 (got ${STAGE})" >&2; exit 2 ;;
esac
