// Programmatic dependent launch (compute capability 9.0 and later): a kernel launched with
// `launch_dependent` may start while the kernel before it on the stream is still running, and does
// its set-up (loads of what the host wrote for the step: row order, context lengths, block table,
// slots) then; it waits at `wait_for_prior_grid` for that kernel to finish and its writes to be
// visible before reading anything the kernel wrote. A kernel lets the next one start early with
// `allow_next_grid`. In a CUDA graph the dependency is captured as a programmatic edge. Only the
// kernel right before is ever still running: it waited for its own predecessor before finishing.
// On older devices, or launched without the attribute, both device calls do nothing.
#pragma once

#include <cuda_runtime.h>

namespace kvc {

__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether the current device runs dependent launches (compute capability 9.0 or later), asked once a device
inline bool dependent_launch_supported() {
  static int major_of[64] = {};  // 0: not asked yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return false;
  if (major_of[device] == 0 && cudaDeviceGetAttribute(&major_of[device], cudaDevAttrComputeCapabilityMajor, device) !=
                                   cudaSuccess)
    return false;
  return major_of[device] >= 9;
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...), allowed to start before the kernel before it
// ends where the device supports it
template <typename... Params, typename... Args>
cudaError_t launch_dependent_shared(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                                    cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = dependent_launch_supported() ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

// the same without dynamic shared memory
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args... args) {
  return launch_dependent_shared(kernel, grid, block, 0, stream, args...);
}

}  // namespace kvc
