// The cache write for quantized pages (2, 4 or 8 bits; K or V, statistics per channel or per
// token): quantize, pack and scatter new tokens into their pages in one pass. Same contract and
// same bytes as paged_torch.write_tokens, which is the reference (see docs/formats.md for the
// append rule). One thread block per (new token, KV head), one thread per channel.
//
// Rounding follows the reference step by step: every multiply, add and divide is an explicitly
// rounded intrinsic, so the compiler cannot fuse a multiply and an add into one FMA.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

constexpr float kEps = 1e-6f;  // smallest scale, as the reference's _EPS

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
__device__ __forceinline__ uint8_t clamped_code(float x, float zero, float step, float top) {
  return uint8_t(fminf(fmaxf(code_on(x, zero, step), 0.f), top));
}

// (zero, scale) of values spanning lo..hi, both rounded through float16 as stored.
__device__ __forceinline__ float2 min_max_stats(float lo, float hi, float top) {
  const float zero = through_half(lo);
  return make_float2(zero, through_half(fmaxf(__fdiv_rn(__fsub_rn(hi, zero), top), kEps)));
}

// One storage byte: 8 / BITS consecutive channels' codes, the first in the lowest bits.
template <int BITS>
__device__ __forceinline__ uint8_t pack_byte(const uint8_t* codes) {
  unsigned byte = 0;
  for (int p = 0; p < 8 / BITS; ++p) byte |= unsigned(codes[p]) << (p * BITS);
  return uint8_t(byte);
}

// Block-wide min and max of one value per thread (blockDim.x a multiple of 32, at most 1024).
__device__ float2 block_min_max(float lo, float hi, float2* scratch) {
  for (int o = 16; o > 0; o >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();  // scratch may still be read by a previous call
  if (threadIdx.x % 32 == 0) scratch[warp] = make_float2(lo, hi);
  __syncthreads();
  float2 r = scratch[0];
  for (int w = 1; w < warps; ++w) r = make_float2(fminf(r.x, scratch[w].x), fmaxf(r.y, scratch[w].y));
  return r;
}

struct Tensor {
  int codes, row_bytes, scale, zero;  // byte offsets in a page, bytes of one (token, head) row
};

// Statistics per token: the token's own row only. Its codes are stored unit-major, [H, row bytes, BLOCK]
// (MinMaxCodec), so a byte of consecutive tokens lies together.
template <typename T, int BITS>
__device__ void write_row_per_token(const T* x_row, uint8_t* page, int h, int off, int D, int BLOCK,
                                    Tensor t, uint8_t* codes, float2* scratch) {
  constexpr float top = float((1 << BITS) - 1);
  constexpr int vals = 8 / BITS;
  const int c = threadIdx.x;
  const bool on = c < D;
  const float x = on ? to_float(x_row[c]) : 0.f;
  const float2 mm = block_min_max(on ? x : INFINITY, on ? x : -INFINITY, scratch);
  const float2 stats = min_max_stats(mm.x, mm.y, top);  // (zero, scale)
  if (on) codes[c] = clamped_code(x, stats.x, stats.y, top);
  __syncthreads();
  if (c < t.row_bytes) page[t.codes + (h * t.row_bytes + c) * BLOCK + off] = pack_byte<BITS>(codes + c * vals);
  if (c == 0) {
    store_half(page + t.scale + (h * BLOCK + off) * 2, stats.y);
    store_half(page + t.zero + (h * BLOCK + off) * 2, stats.x);
  }
}

// Statistics per channel, written by the program of the block's last new token: rows 0..off of
// head h. Rows whose slot was written in this batch are new (``is_new``); the others are decoded
// from the page. Append rule: a channel whose new values all fall on its stored grid keeps its
// statistics and earlier codes; any other channel widens to span its stored grid and its new values,
// and is re-encoded over all rows.
template <typename T, int BITS>
__device__ void write_block_per_channel(const T* src, int64_t src_stride, const int64_t* slots, int i, int64_t blk,
                                        uint8_t* page, int h, int off, int D, int BLOCK, Tensor t,
                                        uint8_t* codes, uint8_t* is_new, float2* scratch) {
  constexpr float top = float((1 << BITS) - 1);
  constexpr int vals = 8 / BITS;
  constexpr unsigned mask = (1u << BITS) - 1;
  const int c = threadIdx.x;
  const bool on = c < D;
  for (int r = c; r <= off; r += blockDim.x) {
    const int j = i - (off - r);
    is_new[r] = j >= 0 && slots[j] == blk * BLOCK + r;
  }
  __syncthreads();
  int has_old = 0;
  for (int r = 0; r <= off; ++r) has_old |= !is_new[r];
  const float zero_old = on ? load_half(page + t.zero + (h * D + c) * 2) : 0.f;
  const float scale_old = on ? load_half(page + t.scale + (h * D + c) * 2) : 1.f;
  // row r's value of this thread's channel: the new token's, or decoded from its stored code
  auto new_value = [&](int r) { return to_float(src[(i - (off - r)) * src_stride + h * D + c]); };
  auto value = [&](int r) {
    return is_new[r] ? new_value(r) : __fadd_rn(__fmul_rn(float(codes[r * D + c]), scale_old), zero_old);
  };
  bool fits = has_old;
  for (int r = 0; r <= off && on; ++r) {
    if (!is_new[r]) continue;
    const float q = code_on(new_value(r), zero_old, scale_old);
    fits = fits && q >= 0.f && q <= top;
  }
  const bool keep = fits || !on;
  // a re-encoded channel rewrites every row, and shares its bytes with kept channels: every row of
  // the head is then unpacked to codes, and repacked once all channels have theirs
  const bool all_rows = __syncthreads_or(!keep);
  uint8_t* rows = page + t.codes + h * BLOCK * t.row_bytes;  // head-major [H, BLOCK, row bytes]
  if (all_rows && on) {
    for (int r = 0; r <= off; ++r)
      if (!is_new[r]) codes[r * D + c] = (rows[r * t.row_bytes + c / vals] >> ((c % vals) * BITS)) & mask;
  }
  float2 stats = make_float2(zero_old, scale_old);  // (zero, scale)
  if (!keep) {  // statistics over the new rows, widened to span the stored grid where there is one;
                // then codes on the new grid (values recomputed, not kept: a block of them would not
                // fit in shared memory next to the codes)
    float lo = INFINITY, hi = -INFINITY;
    for (int r = 0; r <= off; ++r) {
      if (!is_new[r]) continue;
      const float x = new_value(r);
      lo = fminf(lo, x);
      hi = fmaxf(hi, x);
    }
    if (has_old) {
      lo = fminf(lo, zero_old);
      hi = fmaxf(hi, __fadd_rn(zero_old, __fmul_rn(scale_old, top)));
    }
    stats = min_max_stats(lo, hi, top);
    for (int r = 0; r <= off; ++r) codes[r * D + c] = clamped_code(value(r), stats.x, stats.y, top);
  } else if (on) {  // kept: only new rows get codes, on the stored grid
    for (int r = 0; r <= off; ++r)
      if (is_new[r]) codes[r * D + c] = clamped_code(new_value(r), stats.x, stats.y, top);
  }
  __syncthreads();
  for (int k = c; k < (off + 1) * t.row_bytes; k += blockDim.x) {
    const int r = k / t.row_bytes, b = k % t.row_bytes;
    if (all_rows || is_new[r]) rows[k] = pack_byte<BITS>(codes + r * D + b * vals);
  }
  if (on && !keep) {
    store_half(page + t.scale + (h * D + c) * 2, stats.y);
    store_half(page + t.zero + (h * D + c) * 2, stats.x);
  }
}

template <typename T, int BITS, bool PER_CHANNEL>
__global__ void write_kernel(const T* __restrict__ src, int64_t src_stride, const int64_t* __restrict__ slots,
                             uint8_t* __restrict__ cache, int num_tokens, int64_t page_bytes, int D, int BLOCK,
                             Tensor t) {
  extern __shared__ uint8_t smem[];
  __shared__ float2 scratch[32];
  const int i = blockIdx.x, h = blockIdx.y;
  const int64_t slot = slots[i];
  if (slot < 0) return;
  const int64_t blk = slot / BLOCK;
  const int off = int(slot % BLOCK);
  uint8_t* page = cache + blk * page_bytes;
  if constexpr (PER_CHANNEL) {
    const int64_t next = i + 1 < num_tokens ? slots[i + 1] : -1;
    if (next >= 0 && next / BLOCK == blk) return;  // a later token of this batch writes the block
    write_block_per_channel<T, BITS>(src, src_stride, slots, i, blk, page, h, off, D, BLOCK, t, smem,
                                     smem + BLOCK * D, scratch);
  } else {
    write_row_per_token<T, BITS>(src + i * src_stride + h * D, page, h, off, D, BLOCK, t, smem, scratch);
  }
}

template <typename T, int BITS, bool PER_CHANNEL>
void launch(const torch::Tensor& src, const torch::Tensor& slots, torch::Tensor& cache, int64_t page_bytes,
            int BLOCK, Tensor t) {
  const int n = slots.size(0), H = src.size(1), D = src.size(2);
  const int threads = (D + 31) / 32 * 32;
  const size_t shared = PER_CHANNEL ? size_t(BLOCK) * D + BLOCK : size_t(D);
  auto kernel = write_kernel<T, BITS, PER_CHANNEL>;
  if (shared > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)));
  kernel<<<dim3(n, H), threads, shared, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(src.data_ptr()), src.stride(0), slots.data_ptr<int64_t>(), cache.data_ptr<uint8_t>(),
      n, page_bytes, D, BLOCK, t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dispatch(const torch::Tensor& src, const torch::Tensor& slots, torch::Tensor& cache, int64_t page_bytes,
              int BLOCK, int bits, bool per_channel, Tensor t) {
  switch (bits * 2 + per_channel) {
    case 4: return launch<T, 2, false>(src, slots, cache, page_bytes, BLOCK, t);
    case 5: return launch<T, 2, true>(src, slots, cache, page_bytes, BLOCK, t);
    case 8: return launch<T, 4, false>(src, slots, cache, page_bytes, BLOCK, t);
    case 9: return launch<T, 4, true>(src, slots, cache, page_bytes, BLOCK, t);
    case 16: return launch<T, 8, false>(src, slots, cache, page_bytes, BLOCK, t);
    case 17: return launch<T, 8, true>(src, slots, cache, page_bytes, BLOCK, t);
  }
  TORCH_CHECK(false, "kv-compression write kernel: bits=", bits, " (2, 4 or 8 only)");
}

}  // namespace

// src [N, H, D] (rows may be strided; channels contiguous), slots [N] int64 (-1: skip), cache
// [num_blocks, page_bytes] uint8. Writes one tensor (K or V) of the pages.
void write_tensor(torch::Tensor src, torch::Tensor slots, torch::Tensor cache, int64_t page_bytes, int64_t block_size,
                  int64_t bits, bool per_channel, int64_t codes, int64_t row_bytes, int64_t scale, int64_t zero) {
  TORCH_CHECK(src.is_cuda() && slots.is_cuda() && cache.is_cuda(), "write_tensor: CUDA tensors only");
  TORCH_CHECK(src.dim() == 3 && src.stride(2) == 1 && src.stride(1) == src.size(2),
              "write_tensor: src must be [N, H, D] with contiguous heads and channels");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && cache.scalar_type() == torch::kUInt8,
              "write_tensor: slots int64, cache uint8");
  TORCH_CHECK(src.size(2) <= 1024, "write_tensor: head size above 1024");
  if (slots.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());
  const Tensor t{int(codes), int(row_bytes), int(scale), int(zero)};
  switch (src.scalar_type()) {
    case torch::kFloat32: return dispatch<float>(src, slots, cache, page_bytes, block_size, bits, per_channel, t);
    case torch::kFloat16: return dispatch<__half>(src, slots, cache, page_bytes, block_size, bits, per_channel, t);
    case torch::kBFloat16:
      return dispatch<__nv_bfloat16>(src, slots, cache, page_bytes, block_size, bits, per_channel, t);
    default: TORCH_CHECK(false, "write_tensor: float32, float16 or bfloat16 sources only");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_tensor", &write_tensor, "Quantize, pack and scatter new tokens into compressed KV pages");
}
