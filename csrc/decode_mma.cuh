// What the decode kernels over packed pages share (decode_kernel.cu, salient_decode_kernel.cu): the
// tensor-core product of float16 codes, the codes' unpacking into its operands, and how a thread block
// of 2 warps walks a row's pages in slices of 64 tokens.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "dependent_launch.cuh"
#include "vector_words.cuh"

namespace kvc {

constexpr int kHead = 128;    // head size
constexpr int kSlice = 64;    // tokens one warp takes at a time
constexpr int kWarps = 2;
constexpr uint32_t kMagic = 0x64006400u;  // float16 1024.0, twice
constexpr unsigned kAll = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint4 load16(const uint8_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// d += a . b, m16n8k16, float16 operands (a: 16 rows of codes; b: 8 columns, one query's repeated
// or a group's heads), float32 accumulator: d[0], d[1] are row g's columns 2c, 2c + 1 (lane 4g + c),
// d[2], d[3] row g + 8's.
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Codes of plane P (bits P * BITS of a byte) of bytes 0 and 2 as float16 1024 + code * 2^(P * BITS):
// (x & mask) | 1024.0h as one LOP3 (written as two operations, the compiler emits two)
template <int BITS, int P>
__device__ __forceinline__ uint32_t codes(uint32_t x) {
  uint32_t y;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;"
      : "=r"(y)
      : "r"(x), "n"((((1u << BITS) - 1) << (P * BITS)) * 0x00010001u), "r"(kMagic));
  return y;
}

// k-step of plane P: d += codes . b, the codes of rows g and g + 8 from words r0 and r1
template <int BITS, int P>
__device__ __forceinline__ void mma_codes(float (&d)[4], uint32_t r0, uint32_t r1, uint32_t b0, uint32_t b1) {
  mma(d, codes<BITS, P>(r0), codes<BITS, P>(r1), codes<BITS, P>(r0 >> 8), codes<BITS, P>(r1 >> 8), b0, b1);
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ float2 unpack_half2(uint32_t x) {
  return __half22float2(*reinterpret_cast<__half2*>(&x));
}

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ __half from_float(float x, __half*) { return __float2half_rn(x); }
__device__ __forceinline__ __nv_bfloat16 from_float(float x, __nv_bfloat16*) { return __float2bfloat16_rn(x); }

// Float16 number t of 8 N consecutive ones (N uint4), as float
template <int N>
__device__ __forceinline__ float half_at(const uint4 (&v)[N], int t) {
  const uint32_t w = word(v[t >> 3], (t >> 1) & 3);
  return __half2float(__ushort_as_half(static_cast<unsigned short>((t & 1) ? (w >> 16) : (w & 0xFFFF))));
}

// One query row's (MHA) running maximum m (base 2) over a slice whose logits are final: s[i][0] of
// token 8g + i, s[i][2] of token 8g + 4 + i (-inf past the context). Returns the reference the slice's
// probabilities are taken from (0 while no token was seen) and sets alpha, the earlier sums' rescale.
__device__ __forceinline__ float slice_max(const float (&s)[4][4], float& m, float& alpha) {
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int r = 0; r < 4; r += 2) mx = fmaxf(mx, s[i][r]);
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(kAll, mx, off));
  const float m_new = fmaxf(m, mx);
  const float m_ref = m_new == -INFINITY ? 0.f : m_new;  // a slice with no token yet
  alpha = ex2(m - m_ref);
  m = m_new;
  return m_ref;
}

// The slice's probabilities to the p.V products' layout through the warp's row of shared memory
// `probs` (64 floats): lane c takes tokens 16c..16c+15 (pr); lane (g, c) writes tokens 8g + 2c,
// 8g + 2c + 1 (registers s[2c % 4 + e][c / 2 * 2])
__device__ __forceinline__ void slice_probabilities(float4* probs, const float (&s)[4][4], float m_ref, int g, int c,
                                                    float (&pr)[16]) {
  {
    const float s0 = c == 0 ? s[0][0] : c == 1 ? s[2][0] : c == 2 ? s[0][2] : s[2][2];
    const float s1 = c == 0 ? s[1][0] : c == 1 ? s[3][0] : c == 2 ? s[1][2] : s[3][2];
    reinterpret_cast<float2*>(probs)[4 * g + c] = make_float2(ex2(s0 - m_ref), ex2(s1 - m_ref));
  }
  __syncwarp();
#pragma unroll
  for (int q4 = 0; q4 < 4; ++q4) {
    const float4 v4 = probs[4 * c + q4];
    pr[4 * q4] = v4.x;
    pr[4 * q4 + 1] = v4.y;
    pr[4 * q4 + 2] = v4.z;
    pr[4 * q4 + 3] = v4.w;
  }
  __syncwarp();
}

// Two softmax partials over disjoint tokens, each a running maximum (base 2) and sum, as one: the
// merged maximum and sum, and each partial's rescale (0 for a partial that saw no token, maximum -inf;
// both -inf: weights and sum 0). How the two warps' slices are merged, and a split with its row's new token.
struct Merged {
  float m, w0, w1, l;
};
__device__ __forceinline__ Merged merge_partials(float m0, float l0, float m1, float l1) {
  const float m = fmaxf(m0, m1);
  const float w0 = m0 == -INFINITY ? 0.f : ex2(m0 - m);
  const float w1 = m1 == -INFINITY ? 0.f : ex2(m1 - m);
  return {m, w0, w1, l0 * w0 + l1 * w1};
}

// The page of block-table entry `entry`
__device__ __forceinline__ const uint8_t* page_of(const uint8_t* cache, int entry, int64_t page_bytes) {
  return cache + int64_t(entry) * page_bytes;
}

// The block-table entry of a warp's first page, loaded before the context length it would otherwise
// wait for (the page's loads wait for both, one trip to memory sooner); 0 past the `table_blocks`
// entries a launch may index (the pages of max_seq_len, within the table's row)
__device__ __forceinline__ int first_table_entry(const int32_t* table, int b_first, int table_blocks) {
  return b_first < table_blocks ? table[b_first] : 0;
}

// Whether page b of a context of L tokens holds any of the warp's slice (its tokens slice0.. of a page)
template <int BLOCK>
__device__ __forceinline__ bool holds_slice(int b, int slice0, int L) { return b * BLOCK + slice0 < L; }

// Where a warp's slices lie: pages b_first, b_first + STEP, ... of its split, tokens slice0.. of each
template <int BLOCK>
struct WarpSlices {
  static_assert(BLOCK == kSlice || BLOCK == kWarps * kSlice, "pages of 64 or 128 tokens");
  static constexpr int SLICES = BLOCK / kSlice;   // a page's slices
  static constexpr int STEP = kWarps / SLICES;    // pages from one of a warp's slices to its next
  __device__ static int first_page(int b_start, int warp) { return b_start + (SLICES == 1 ? warp : 0); }
  __device__ static int slice0(int warp) { return (warp % SLICES) * kSlice; }
};

// The output of a split launch from its partials ([rows, query heads, splits, head size + 2]: the
// split's unnormalized output, its maximum in base-2 units, its sum), as triton_kernels/decode.py's
// _merge_splits_kernel: a thread block a (row, query head), a thread a channel. LSE_OUT: and the
// natural log-sum-exp into `lse` ([query head, row], heads `lse_stride` apart).
template <typename T, bool LSE_OUT = false>
__global__ void __launch_bounds__(kHead) merge_splits(const float* __restrict__ part, T* __restrict__ out,
                                                      int64_t out_stride, int num_splits, float* __restrict__ lse,
                                                      int64_t lse_stride) {
  kvc::wait_for_prior_grid();
  const int row = blockIdx.x, qhead = blockIdx.y, ch = threadIdx.x;
  const float* split0 = part + (int64_t(row) * gridDim.y + qhead) * num_splits * (kHead + 2);
  float mm = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mm = fmaxf(mm, split0[s * (kHead + 2) + kHead]);
  float sum_out = 0.f, sum_l = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    const float* split = split0 + s * (kHead + 2);
    const float w = ex2(split[kHead] - mm);  // 0 for a split that saw no token (maximum -inf)
    sum_out = fmaf(split[ch], w, sum_out);
    sum_l = fmaf(split[kHead + 1], w, sum_l);
  }
  out[int64_t(row) * out_stride + qhead * kHead + ch] = from_float(sum_out / sum_l, static_cast<T*>(nullptr));
  if constexpr (LSE_OUT) {
    if (ch == 0) lse[qhead * lse_stride + row] = (mm + __log2f(sum_l)) / kLog2e;
  }
}

// ZipCache's decode row (MHA): its output from its two warps' partials (merge_partials' weights w0,
// w1) and, in split 0, its own new token, a partial of its own: one split writes the result and the
// natural log-sum-exp the decode write scores with; several, their unnormalized partials (merged by
// merge_splits<T, true>). With no history (a padding row), the new token alone.
template <typename T>
struct OwnTokenOutput {
  float w0, w1, w_kept, w_own, inv_total, top, total;
  bool first_split, one_split;
  const T* new_v;  // the row's new V of this head
  T* dst;          // its output
  float* partial;  // its split's partial (head size + 2 floats)

  __device__ OwnTokenOutput(float m0, float l0, float m1, float l1, float own, int split, int num_splits,
                            const T* new_v, T* dst, float* partial)
      : first_split(split == 0), one_split(num_splits == 1), new_v(new_v), dst(dst), partial(partial) {
    const Merged warps = merge_partials(m0, l0, m1, l1);
    w0 = warps.w0, w1 = warps.w1;
    const Merged with_own = first_split ? merge_partials(warps.m, warps.l, own, 1.f) : Merged{warps.m, 1.f, 0.f, warps.l};
    top = with_own.m, w_kept = with_own.w0, w_own = with_own.w1, total = with_own.l;
    inv_total = 1.f / total;  // one division: 32 a lane (IEEE, each with its slow path) took 6%
  }

  // channel ch of the output, from this warp's (`mine`) and the other's (`other`) unnormalized sums
  __device__ __forceinline__ void put(int ch, float mine, float other) const {
    const float kept = mine * w0 + other * w1;
    const float v = kept * w_kept + (first_split ? to_float(new_v[ch]) * w_own : 0.f);  // kept: 0 if no history
    if (one_split)
      dst[ch] = from_float(v * inv_total, static_cast<T*>(nullptr));
    else
      partial[ch] = v;  // unnormalized output of this split
  }

  // the log-sum-exp (one split: at `lse`), or the split's maximum and sum after its partial
  __device__ __forceinline__ void finish(float* lse) const {
    if (one_split) {
      *lse = (top + __log2f(total)) / kLog2e;
    } else {
      partial[kHead] = top;
      partial[kHead + 1] = total;
    }
  }
};

// Launches a ZipCache decode kernel over decode rows (a thread block of kWarps warps a (row, head,
// split)), its arguments those of salient_decode_kernel.cu's SalientDecodeArgs and decode_kernel.cu's
// SalientRowsDecodeArgs, then, where a row has several splits, their merge with the log-sum-exp
template <typename T, typename Args, typename Offsets>
cudaError_t launch_own_token_decode(
    void (*kernel)(const T*, const uint8_t*, const int32_t*, const int32_t*, const int32_t*, const T*, const T*, T*,
                   float*, float*, float, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int,
                   int, Offsets),
    const Args& a, const Offsets& o) {
  const auto stream = static_cast<cudaStream_t>(a.stream);
  float* lse = static_cast<float*>(a.lse);
  cudaError_t err = launch_dependent(
      kernel, dim3(a.num_rows * a.num_heads, a.num_splits), dim3(kWarps * 32), stream, static_cast<const T*>(a.query),
      static_cast<const uint8_t*>(a.cache), static_cast<const int32_t*>(a.block_table),
      static_cast<const int32_t*>(a.seq_lens), static_cast<const int32_t*>(a.row_order), static_cast<const T*>(a.key),
      static_cast<const T*>(a.value), static_cast<T*>(a.out), static_cast<float*>(a.part), lse, a.q_scale, a.q_stride,
      a.k_stride, a.v_stride, a.out_stride, a.bt_stride, a.page_bytes, a.lse_stride, a.blocks_per_split, a.num_splits,
      a.table_blocks, a.num_heads, o);
  if (err == cudaSuccess && a.num_splits > 1)
    err = launch_dependent(merge_splits<T, true>, dim3(a.num_rows, a.num_heads), dim3(kHead), stream,
                           static_cast<const float*>(a.part), static_cast<T*>(a.out), a.out_stride, a.num_splits, lse,
                           a.lse_stride);
  return err;
}

}  // namespace kvc
