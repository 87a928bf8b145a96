#!/usr/bin/env bash
# On the GPU machine, after vLLM is installed (see docs/benchmarks.md): install the plugin,
# run the GPU tests, the decode-kernel benchmark and the end-to-end check; logs go to $OUT.
# Scripts run from outside the checkout, so its triton_kernels/ folder cannot shadow the
# upstream package of that name that vLLM imports.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/results}; mkdir -p "$OUT"
export VLLM_HOST_IP=127.0.0.1 PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
(cd "$REPO" && python -m pip install -q --no-deps --no-build-isolation -e .) > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
cd /tmp
python -c "import vllm_kvcompress" || { echo "plugin not importable"; exit 1; }
python -c "import torch; print(torch.cuda.get_device_name(), torch.__version__)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 150 python -m pytest -q -p no:cacheprovider --rootdir "$REPO" "$REPO/tests/test_triton_decode.py" \
    "$REPO/tests/test_triton_write.py" "$REPO/tests/test_triton_slim.py" "$REPO/tests/test_formats.py" 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
fi
[ "${SKIP_KERNELS:-0}" = 1 ] || timeout 200 python "$REPO/benchmarks/kernels.py" --out "$OUT/kernels.json" ${KERNEL_ARGS:-} 2>&1 | tee "$OUT/kernels.log" | grep -v Warning
if [ "${SKIP_E2E:-0}" != 1 ]; then
  timeout 330 python "$REPO/benchmarks/gpu_smoke.py" --out "$OUT/gpu_smoke.json" ${SMOKE_ARGS:-} > "$OUT/gpu_smoke.log" 2>&1
  grep -E "^quant|Error" "$OUT/gpu_smoke.log" | tail -20
fi
