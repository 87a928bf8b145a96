#!/usr/bin/env bash
# On the GPU machine: install vLLM from the offline payload chunks in ${VIN:-/tmp/vin} (docs/gpu.md)
# into /tmp/vsite; then `source /tmp/vsite/vllm-env.sh` in the shell that runs vLLM.
set -euo pipefail
cd "${VIN:-/tmp/vin}"
cat part-* > payload.tar && sha256sum -c --ignore-missing SHA256SUMS > /dev/null && tar -xf payload.tar
VLLM_SITE=/tmp/vsite bash vllm-*-payload/install_on_gpu.sh > install.log 2>&1 || { tail -20 install.log; exit 1; }
