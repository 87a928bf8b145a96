// Word i (0..3) of a 16-byte vector: how the kernels take packed codes from their 16-byte loads.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace kvc {

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

}  // namespace kvc
