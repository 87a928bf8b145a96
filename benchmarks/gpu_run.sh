#!/usr/bin/env bash
# On the GPU machine, after vLLM is installed (see docs/gpu.md): install the plugin, run the GPU
# end-to-end check, the GPU tests, the kernel benchmark and a profile of one decode launch; logs go
# to $OUT. Scripts run from outside the checkout, so its triton_kernels/ folder cannot shadow the
# upstream package of that name that vLLM imports.
#   Knobs: SKIP_TESTS=1 SKIP_KERNELS=1 SKIP_NCU=1 SKIP_E2E=1 KERNEL_ARGS=--sweep SMOKE_ARGS=--compare-only
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/results}; mkdir -p "$OUT"
export VLLM_HOST_IP=127.0.0.1 PYTHONUNBUFFERED=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
(cd "$REPO" && python -m pip install -q --no-deps --no-build-isolation -e .) > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
cd /tmp
python -c "import vllm_kvcompress" || { echo "plugin not importable"; exit 1; }
python -c "import torch; print(torch.cuda.get_device_name(), torch.__version__)"
if [ "${SKIP_E2E:-0}" != 1 ]; then
  PYTHONPATH="$REPO/tests${PYTHONPATH:+:$PYTHONPATH}" timeout 170 python "$REPO/benchmarks/gpu_smoke.py" --out "$OUT/gpu_smoke.json" ${SMOKE_ARGS:-} > "$OUT/gpu_smoke.log" 2>&1
  grep -E "^quant|Error" "$OUT/gpu_smoke.log" | tail -20
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 170 python -m pytest -q -p no:cacheprovider --rootdir "$REPO" "$REPO/tests/test_triton_decode.py" \
    "$REPO/tests/test_triton_write.py" "$REPO/tests/test_triton_slim.py" "$REPO/tests/test_formats.py" 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
fi
[ "${SKIP_KERNELS:-0}" = 1 ] || timeout 170 python "$REPO/benchmarks/kernels.py" --out "$OUT/kernels.json" ${KERNEL_ARGS:-} 2>&1 | tee "$OUT/kernels.log" | grep -v Warning
if [ "${SKIP_NCU:-0}" != 1 ]; then
  timeout 90 ncu --clock-control none --kernel-name regex:_decode_kernel --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats --section InstructionStats \
    python "$REPO/benchmarks/kernels.py" --profile ${NCU_CASE:-4 32 32} > "$OUT/ncu.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Issue Slots Busy|Stall|L1/TEX Hit|L2 Hit" "$OUT/ncu.txt" | head -20
fi
