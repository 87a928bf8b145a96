// The codecs' min-max grid on the GPU (codecs.min_max_grid, codes_on, widened_span), shared by the
// CUDA writes: rounding as the torch reference's, step by step. Every multiply, add and divide is an
// explicitly rounded intrinsic, so the compiler cannot fuse a multiply and an add into one FMA.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace kvc {

// formats.EPS and formats.WIDEN_MARGIN, passed by cuda_jit at build
#if !defined(KVC_EPS) || !defined(KVC_WIDEN_MARGIN)
#error "build through vllm_kvcompress.cuda_jit, which passes the formats' constants"
#endif
constexpr float kEps = KVC_EPS;  // smallest scale
constexpr float kWidenMargin = KVC_WIDEN_MARGIN;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// float rounded to float16 and back, as the reference's .to(float16).float()
__device__ __forceinline__ float through_half(float x) { return __half2float(__float2half_rn(x)); }

__device__ __forceinline__ float load_half(const uint8_t* p) {
  return __half2float(*reinterpret_cast<const __half*>(p));
}

__device__ __forceinline__ void store_half(uint8_t* p, float x) {
  *reinterpret_cast<__half*>(p) = __float2half_rn(x);
}

// Unclamped code of x on the grid zero + k * step, rounded half up.
__device__ __forceinline__ float code_on(float x, float zero, float step) {
  return floorf(__fadd_rn(__fdiv_rn(__fsub_rn(x, zero), step), 0.5f));
}

// The code of x on that grid, clamped to 0..top.
__device__ __forceinline__ unsigned clamped_code(float x, float zero, float step, float top) {
  return unsigned(fminf(fmaxf(code_on(x, zero, step), 0.f), top));
}

// The value code stands for on the grid zero + k * step.
__device__ __forceinline__ float decoded(unsigned code, float zero, float step) {
  return __fadd_rn(__fmul_rn(float(code), step), zero);
}

// (zero, scale) of values spanning lo..hi, both rounded through float16 as stored.
__device__ __forceinline__ float2 min_max_stats(float lo, float hi, float top) {
  const float zero = through_half(lo);
  return make_float2(zero, through_half(fmaxf(__fdiv_rn(__fsub_rn(hi, zero), top), kEps)));
}

// Bounds of a widened channel's grid: its stored grid zero..grid_top and its new values lo..hi,
// moved out by kWidenMargin of the span on each side they pass (codecs.widened_span).
__device__ __forceinline__ float2 widened_span(float lo, float hi, float zero, float grid_top) {
  const float a = fminf(lo, zero), b = fmaxf(hi, grid_top);
  const float margin = __fmul_rn(__fsub_rn(b, a), kWidenMargin);
  return make_float2(lo < zero ? __fsub_rn(a, margin) : a, hi > grid_top ? __fadd_rn(b, margin) : b);
}

}  // namespace kvc
