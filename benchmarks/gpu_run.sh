#!/usr/bin/env bash
# On the GPU machine, after vLLM is installed (see docs/benchmarks.md): install the plugin,
# run the GPU tests, the decode-kernel benchmark and the end-to-end check; logs go to $OUT.
set -uo pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"
export VLLM_HOST_IP=127.0.0.1 PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python -c "import torch; print(torch.cuda.get_device_name(), torch.__version__)"
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_triton_decode.py tests/test_triton_write.py tests/test_formats.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
timeout 150 python -m benchmarks.kernels --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | grep -v Warning
[ "${SKIP_E2E:-0}" = 1 ] || timeout 280 python -m benchmarks.gpu_smoke --out "$OUT/gpu_smoke.json" > "$OUT/gpu_smoke.log" 2>&1; grep -E "^quant|Error|error" "$OUT/gpu_smoke.log" | tail -20
