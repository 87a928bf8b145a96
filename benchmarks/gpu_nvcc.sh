# On the GPU machine, sourced: unpack the compiler archive of benchmarks/pack_nvcc.sh and point
# torch's extension builder at it, so the CUDA write kernel (csrc/) can be built.
#   source benchmarks/gpu_nvcc.sh .gpu/nvcc/cuda13-nvcc.tar.xz
mkdir -p /tmp/cuda13 && tar -xJf "$1" -C /tmp/cuda13
export CUDA_HOME=/tmp/cuda13 PATH=/tmp/cuda13/bin:$PATH TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
