#!/usr/bin/env bash
# On a machine with the package registry: pack the CUDA 13.0 compiler (nvcc, cicc, ptxas, headers,
# libcudart) from NVIDIA's wheels into one archive small enough to travel to the GPU machine, which
# has no nvcc, for the CUDA write kernel (csrc/). About 42 MB; compiling needs nothing else.
#   bash benchmarks/pack_nvcc.sh OUT.tar.xz
set -euo pipefail
out=$(realpath "$1")
work=$(mktemp -d)
python -m pip download --no-deps -q -d "$work" "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.88" \
  "nvidia-cuda-crt==13.0.88" "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85"
for wheel in "$work"/*.whl; do python -m zipfile -e "$wheel" "$work/x"; done
cd "$work/x/nvidia/cu13"
chmod +x bin/* nvvm/bin/*
ln -sfn lib lib64                                  # torch's extension builder links -L$CUDA_HOME/lib64
(cd lib && ln -sf libcudart.so.13 libcudart.so)
# not needed to compile and link a torch extension: the device linker, libnvvm (cicc has it built
# in), static libraries
tar -cJf "$out" --exclude='lib/cmake' --exclude='lib/*.a' --exclude='lib/libnvvm*' --exclude='bin/nvlink' \
  --exclude='bin/__nvcc_device_query' bin nvvm include lib lib64
rm -rf "$work"
ls -la "$out"
