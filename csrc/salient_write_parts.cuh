// What ZipCache's two CUDA decode writes share (salient_write_kernel.cu over slot-map pages,
// salient_rows_write_kernel.cu over split-row pages): one warp per (decode row, KV head), kWriteWarps
// a thread block; each KV head's query heads' probes in dynamic shared memory; a warp's K grids for
// its new token, and the tables that re-code a widened channel's earlier codes; their launch. Lane l
// holds the channels 4 (l + 32 jb) .. + 3 of its GROUPS groups; arithmetic as the torch reference's
// (min_max_grid.cuh).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dependent_launch.cuh"
#include "min_max_grid.cuh"

#ifndef KVC_SALIENT_MIDDLE
#error "build through vllm_kvcompress.cuda_jit, which passes the formats' constants"
#endif

namespace kvc {

constexpr float kSalientTop = 15.f;  // the shared grid's highest code (4 bits)
constexpr int kWriteWarps = 4;       // warps a thread block, each on its own row and head
// a warp's probe floats (probe_floats), at most: 48 KB of dynamic shared memory a block (with the
// warps' scratch, more than a launch takes without asking: see launch_write_warps)
constexpr int kMaxProbeFloats = 48 * 1024 / (kWriteWarps * 4);

// Floats a warp's probes take in dynamic shared memory: for each query head of the KV head, the
// query times K's channel steps [D], then its logit bias, the middle's steps of the summed scaled
// query, its log-sum-exp and the new token's logit
__host__ __device__ constexpr int probe_floats(int group, int head_size) { return group * (head_size + 4); }

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Nibble n of x as a float: its bits as the mantissa of 2^23 + nibble, less 2^23 (no conversion unit)
__device__ __forceinline__ float nibble(uint32_t x, int n) {
  return __uint_as_float(0x4B000000u | ((x >> (4 * n)) & 15u)) - 8388608.f;
}

// Each query head g of KV head h's probe (the decode row's query of head h * group + g): the query
// times the stored grid's channel steps into q_steps[g * D ..] (where the lanes read the same channels
// at once as each scores its own tokens), and terms[g] = (sum q zero, middle * sum of the scaled query,
// the row's log-sum-exp, the new token's logit). A token's logit on the stored grid is then
// sum_c q_steps_c level_c + bias. Ends with the probes written (__syncwarp).
template <int D, int GROUPS, typename T>
__device__ __forceinline__ void write_probes(float* q_steps, float4* terms, const T* query, int64_t q_head_stride,
                                             const float* lse, int64_t lse_head_stride, const uint8_t* page,
                                             int k_scale_at, int k_zero_at, const T* k_src, int h, int group,
                                             int lane) {
  for (int g = 0; g < group; ++g) {
    const int head = h * group + g;
    const T* q_src = query + head * q_head_stride;
    float bias = 0.f, own = 0.f, q_sum = 0.f;
#pragma unroll
    for (int jb = 0; jb < GROUPS; ++jb) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int c = 4 * (lane + 32 * jb) + k;
        if (c >= D) continue;
        const float q = to_float(q_src[c]);
        const float qs = q * load_half(page + k_scale_at + (h * D + c) * 2);
        q_steps[g * D + c] = qs;
        q_sum += qs;
        bias += q * load_half(page + k_zero_at + (h * D + c) * 2);
        own += q * to_float(k_src[c]);
      }
    }
    bias = warp_sum(bias), own = warp_sum(own), q_sum = warp_sum(q_sum);
    if (lane == 0) terms[g] = make_float4(bias, KVC_SALIENT_MIDDLE * q_sum, lse[head * lse_head_stride], own);
  }
  __syncwarp();
}

// The new token's K grids per channel of the lane's groups: kept (a value on its stored grid), widened
// past the stored grid (the 4-bit codec's append rule), or the value's own (a block's first token,
// off == 0); the value's 4-bit code on it (channel 4 (l + 32 jb) + k in bits 4 k of k_code[jb]); bit
// 4 jb + k of the result: the channel takes a new grid.
template <int D, int GROUPS, typename T>
__device__ __forceinline__ unsigned new_token_grids(const T* k_src, const uint8_t* page, int k_zero_at, int k_scale_at,
                                                    int h, int off, int lane, float (&old_zero)[GROUPS][4],
                                                    float (&old_step)[GROUPS][4], float (&zero)[GROUPS][4],
                                                    float (&step)[GROUPS][4], unsigned (&k_code)[GROUPS]) {
  unsigned regridded = 0;
#pragma unroll
  for (int jb = 0; jb < GROUPS; ++jb) {
    k_code[jb] = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int c = 4 * (lane + 32 * jb) + k;
      old_zero[jb][k] = 0.f, old_step[jb][k] = 1.f, zero[jb][k] = 0.f, step[jb][k] = 1.f;
      if (c >= D) continue;
      const float x = to_float(k_src[c]);
      float q = 0.f;
      bool kept = false;
      if (off > 0) {
        old_zero[jb][k] = load_half(page + k_zero_at + (h * D + c) * 2);
        old_step[jb][k] = load_half(page + k_scale_at + (h * D + c) * 2);
        q = code_on(x, old_zero[jb][k], old_step[jb][k]);
        kept = q >= 0.f && q <= kSalientTop;
      }
      float2 grid = make_float2(old_zero[jb][k], old_step[jb][k]);
      if (!kept) {
        const float2 span = off == 0 ? make_float2(x, x)
                                     : widened_span(x, x, old_zero[jb][k],
                                                    __fadd_rn(old_zero[jb][k], __fmul_rn(old_step[jb][k], kSalientTop)));
        grid = min_max_stats(span.x, span.y, kSalientTop);
        q = float(clamped_code(x, grid.x, grid.y, kSalientTop));
        regridded |= 1u << (4 * jb + k);
      }
      zero[jb][k] = grid.x, step[jb][k] = grid.y;
      k_code[jb] |= unsigned(q) << (4 * k);
    }
  }
  return regridded;
}

// The widened channels' tables: refined[c] the new code by old 4-bit code (4 bits each), middle[c] by a
// 2-bit token's code h (its level 4 h + middle). A round at a time, every lane with a widened channel
// left lists one (its grids in listed_grid, 32 of them), and a team of lanes codes each listed channel's
// 16 refined levels and 4 middles, as many lanes a channel as let the round's channels fit the warp (16
// at most), the team's codes OR'd together by shuffles. Most tokens widen a few channels (a team of 16
// lanes each), a block's first tokens most of theirs (a lane each). Entries OR'd into the tables by
// atomics instead (a 64-bit OR on shared memory is a compare-and-swap loop, 16 lanes on one entry) took
// 89 of the write's 123 us where a block's first tokens widen (H200, 144 MHA rows,
// benchmarks/experiments/salient_write_ab.py). Ends with the warp's tables written (__syncwarp).
template <int GROUPS>
__device__ __forceinline__ void widened_tables(unsigned regridded, const float (&old_zero)[GROUPS][4],
                                               const float (&old_step)[GROUPS][4], const float (&zero)[GROUPS][4],
                                               const float (&step)[GROUPS][4], int lane, float4* listed_grid,
                                               uint16_t* listed_channel, unsigned long long* refined_table,
                                               unsigned* middle_table) {
  constexpr unsigned kAllLanes = 0xffffffffu;
  unsigned pending = regridded;
  while (__any_sync(kAllLanes, pending != 0)) {
    const unsigned listing = __ballot_sync(kAllLanes, pending != 0);
    __syncwarp();  // the last round's reads of the listed grids (or the caller's of their place) are done
    if (pending != 0) {
      const int bit = __ffs(pending) - 1;  // 4 jb + k
      pending &= pending - 1;
      float4 grid = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int jb = 0; jb < GROUPS; ++jb)
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (bit == 4 * jb + k) grid = make_float4(old_zero[jb][k], old_step[jb][k], zero[jb][k], step[jb][k]);
      const int rank = __popc(listing & ((1u << lane) - 1u));
      listed_grid[rank] = grid;
      listed_channel[rank] = uint16_t(4 * (lane + 32 * (bit / 4)) + bit % 4);
    }
    __syncwarp();
    const int listed = __popc(listing);
    const int team_bits = min(4, 31 - __clz(32 / listed));  // log2 of 32 / listed, rounded down
    const int team = 1 << team_bits, n = lane >> team_bits, member = lane & (team - 1);
    unsigned long long refined = 0;
    unsigned middle = 0;
    if (n < listed) {
      const float4 g = listed_grid[n];  // old zero, old step, zero, step
      const int share = 16 >> team_bits;
      for (int level = member * share; level < (member + 1) * share; ++level)
        refined |= (unsigned long long)clamped_code(__fadd_rn(__fmul_rn(float(level), g.y), g.x), g.z, g.w,
                                                    kSalientTop)
                   << (4 * level);
      for (int high = member; high < 4; high += team)
        middle |= clamped_code(__fadd_rn(__fmul_rn(float(4 * high) + KVC_SALIENT_MIDDLE, g.y), g.x), g.z, g.w,
                               kSalientTop)
                  << (4 * high);
    }
    for (int o = 1; o < team; o <<= 1) {
      refined |= __shfl_xor_sync(kAllLanes, refined, o);
      middle |= __shfl_xor_sync(kAllLanes, middle, o);
    }
    if (n < listed && member == 0) {
      const int c = listed_channel[n];
      refined_table[c] = refined;
      middle_table[c] = middle;
    }
  }
  __syncwarp();
}

// Launches a write kernel over the rows' (row, KV head) items, kWriteWarps a thread block, with the
// probes' dynamic shared memory. A block takes 48 KB of shared memory, static and dynamic, without
// asking for more; the warps' scratch and the most probes (kMaxProbeFloats) take up to 64 KB, which
// every GPU the kernels are built for grants on asking. Asked once a kernel, at its first launch past
// 48 KB (the warm-up's).
template <auto Kernel, int D, size_t kScratchBytes, typename Args>
cudaError_t launch_write_warps(const Args& a) {
  const int items = a.num_rows * a.num_heads;
  const size_t probes = size_t(kWriteWarps) * probe_floats(a.group, D) * sizeof(float);
  static size_t granted = 48 * 1024 - kScratchBytes;
  if (probes > granted) {
    const cudaError_t err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(probes));
    if (err != cudaSuccess) return err;
    granted = probes;
  }
  return launch_dependent_shared(Kernel, dim3((items + kWriteWarps - 1) / kWriteWarps), dim3(kWriteWarps * 32),
                                 probes, static_cast<cudaStream_t>(a.stream), a);
}

// A write's entry point (kvc_salient_write, kvc_salient_rows_write): the launch of Write::launch<T, D>
// for the arguments' element type (dtype 1 float16, 2 bfloat16) and head size (64, 128, 256), where
// those, `pages_covered` and the query heads a KV head (their probes within kMaxProbeFloats) are
// what the kernel covers; else cudaErrorInvalidValue.
template <typename Write, typename Args>
int run_write(const Args& a, bool pages_covered) {
  using Launcher = cudaError_t (*)(const Args&);
  const auto of_head_size = [&](auto element) -> Launcher {
    using T = decltype(element);
    return a.head_size == 64    ? Write::template launch<T, 64>
           : a.head_size == 128 ? Write::template launch<T, 128>
           : a.head_size == 256 ? Write::template launch<T, 256>
                                : nullptr;
  };
  const Launcher f = a.dtype == 1 ? of_head_size(__half{}) : a.dtype == 2 ? of_head_size(__nv_bfloat16{}) : nullptr;
  if (f == nullptr || !pages_covered || a.group < 1 || probe_floats(a.group, a.head_size) > kMaxProbeFloats)
    return static_cast<int>(cudaErrorInvalidValue);
  if (a.num_rows == 0) return 0;
  return static_cast<int>(f(a));
}

}  // namespace kvc
