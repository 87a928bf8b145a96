// ZipCache's decode write (formats.salient): each decode row's new token into the last block of its
// request, with the block's choice of 4-bit tokens. Same contract and pages as
// salient_torch.write_decoded, the reference, and as the Triton write's decode rows
// (triton_kernels/salient_write.py, which serves where there is no nvcc); docs/formats.md has the
// rule.
//
// MHA and GQA: a token's score sums the probabilities its KV head's query heads give it, each query
// head's probe in dynamic shared memory (probe_floats, at most kMaxProbeFloats a warp).
//
// One warp per (decode row, KV head), with no barrier but the warp's own. Lane l holds bytes l,
// l + 32 of a token's rows (a byte is 4 channels of a plane) and tokens l, l + 32, .. of the block:
// - the choice: where the block's quota does not take every candidate, the probe's scores (each lane
//   scores its own tokens, their K rows loaded whole in 16-byte vectors, the probe times the
//   channels' steps read from shared memory); then the least-scored candidate is dropped (the
//   block's slots full) or every candidate ranked (a re-compression);
// - K's grid per channel: a new value on its stored grid keeps it, any other widens (the 4-bit
//   codec's append rule, min_max_grid.cuh);
// - a widened channel's earlier codes are mapped through tables of new code by old level (the 16
//   levels of a 4-bit token, the 4 of a 2-bit one), built with the reference's arithmetic;
// - the new token's rows, in the lowest free slot where it keeps 4 bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "dependent_launch.cuh"
#include "min_max_grid.cuh"
#include "salient_codes.cuh"
#include "salient_write_parts.cuh"
#include "vector_words.cuh"

#ifndef KVC_NO_SLOT
#error "build through vllm_kvcompress.cuda_jit, which passes the formats' constants"
#endif

namespace {

using namespace kvc;
constexpr unsigned kAll = 0xffffffffu;
constexpr int kMaxBlock = 128;                // tokens a block (4 a lane)
constexpr int kMaxTokensALane = kMaxBlock / 32;
constexpr unsigned kNoSlot = KVC_NO_SLOT;     // slot_of of a 2-bit token

}  // namespace

// A launch's arguments, one struct so that the caller (ctypes) converts one pointer a call;
// cuda_salient_write.py's _SalientWriteArgs mirrors it field for field.
struct SalientWriteArgs {
  const void* query;        // [N, H * group, D], rows q_row_stride apart, heads q_head_stride
  const void* key;          // [N, H, D], rows k_row_stride apart
  const void* value;        // [N, H, D], rows v_row_stride apart
  const void* lse;          // float32 natural log-sum-exp of each row's attention, [row, query head]
  const void* given;        // float32 [N, B, H] drawn scores (score: random), or null: from the query
  const void* block_table;  // int32 [N, table_stride]
  const void* seq_lens;     // int32 [N]: each row's context with its new token (0: a padding row)
  const void* quotas;       // int32 [B + 1]: 4-bit tokens a block of n keeps after a re-compression
  void* cache;              // [num_blocks, page_bytes] uint8
  int64_t q_row_stride, q_head_stride, k_row_stride, v_row_stride, lse_row_stride, lse_head_stride;
  int64_t table_stride, page_bytes;
  int num_rows, num_heads, head_size, block_size, slots;
  int k_scale, k_zero, v_scale, v_zero, k_high, v_high, k_low, v_low, slot_of;  // byte offsets in a page
  int interval;  // a re-compression every `interval` tokens of context
  int window;    // the probe sees the tokens of its last `window` positions
  float scale;   // the softmax scale
  int dtype;     // of query, key and value: 1 float16, 2 bfloat16
  void* stream;  // a cudaStream_t
  int group;     // query heads a KV head (heads h * group .. of KV head h)
};

namespace {

// A warp's scratch: the scores a re-compression ranks, and the widened channels' tables.
template <int D>
struct alignas(16) Scratch {
  float score[kMaxBlock];                    // a candidate's score (NaN: not a candidate), read 4 at once;
                                             // after the choice, a widening round's listed grids
  unsigned long long refined_table[D];       // a widened channel's new code by old 4-bit code, 4 bits each
  unsigned middle_table[D];                  // by a 2-bit token's high code h (level 4 h + kSalientMiddle)
  uint16_t listed_channel[32];               // the channels whose tables a round codes
  uint8_t widened[D / 4];                    // a byte's widened channels, bit k: channel 4 b + k
};

// The 2-bit code of channel k (0..3) of a byte.
__device__ __forceinline__ unsigned code2(unsigned byte, int k) { return (byte >> (2 * k)) & 3u; }

__device__ __forceinline__ unsigned warp_or(unsigned x) {
  for (int o = 16; o > 0; o >>= 1) x |= __shfl_xor_sync(kAll, x, o);
  return x;
}

// A stored token's K row, D / 4 bytes (4 channels a byte, channel 4 b + k in bits 2 k of byte b), whole
// in 16-byte vectors; null: zeros (a 2-bit token's refinement)
template <int D>
__device__ __forceinline__ void load_row(uint4 (&row)[D / 64], const uint8_t* at) {
#pragma unroll
  for (int v = 0; v < D / 64; ++v)
    row[v] = at != nullptr ? *reinterpret_cast<const uint4*>(at + 16 * v) : make_uint4(0, 0, 0, 0);
}

// q_step . levels of a stored token: its high plane and refinement rows (load_row)
template <int D>
__device__ __forceinline__ float stored_logit(const uint4 (&hv)[D / 64], const uint4 (&lv)[D / 64],
                                              const float* q_step) {
  float sum = 0.f;
#pragma unroll
  for (int v = 0; v < D / 64; ++v)
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t hw = word(hv[v], w), lw = word(lv[v], w);
      const uint32_t even = join_even(hw, lw), odd = join_odd(hw, lw);
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const float4 q = reinterpret_cast<const float4*>(q_step)[16 * v + 4 * w + b];  // channels 4 (16 v + 4 w + b)..
        sum += q.x * nibble(even, 2 * b) + q.y * nibble(odd, 2 * b) + q.z * nibble(even, 2 * b + 1) +
               q.w * nibble(odd, 2 * b + 1);
      }
    }
  return sum;
}

template <typename T, int D>
// 6 blocks a SM, 80 registers (spilling a little on the scoring path): H200, 144 rows of Llama-2-7B's
// shape, widening / held / slots full 72.8 / 64.4 / 86.0 us; 8 blocks 75.5 / 65.2 / 83.3; 10 blocks 79.8 /
// 67.3 / 87.9; uncapped (168 registers) 90.6 / 68.5 / 149.0
__global__ void __launch_bounds__(kWriteWarps * 32, 6) salient_write_kernel(const SalientWriteArgs a) {
  constexpr int U = D / 4;                  // bytes a plane's row
  constexpr int BYTES = (U + 31) / 32;      // a lane's bytes of a row
  __shared__ Scratch<D> scratch[kWriteWarps];
  extern __shared__ float4 probe_shared_vectors[];  // probe_floats(group, D) floats a warp
  float* probe_shared = reinterpret_cast<float*>(probe_shared_vectors);
  kvc::allow_next_grid();  // the kernel after may set up while this writes
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int item = blockIdx.x * kWriteWarps + warp;
  if (item >= a.num_rows * a.num_heads) return;
  Scratch<D>& s = scratch[warp];
  const int i = item / a.num_heads, h = item % a.num_heads, H = a.num_heads, B = a.block_size, R = a.slots;
  const int length = static_cast<const int32_t*>(a.seq_lens)[i];
  if (length == 0) return;  // a full CUDA graph's padding row
  const int off = (length - 1) % B;  // the new token's place in its block, after `off` stored tokens
  const int64_t block = static_cast<const int32_t*>(a.block_table)[i * a.table_stride + (length - 1) / B];
  const int quota = length % a.interval != 0 ? R : static_cast<const int32_t*>(a.quotas)[off + 1];
  uint8_t* page = static_cast<uint8_t*>(a.cache) + block * a.page_bytes;
  uint8_t* slot_of = page + a.slot_of + h * B;

  // the lane's tokens: their slots, and which are earlier 4-bit tokens (the candidates but the new one)
  int slot[kMaxTokensALane];
  unsigned earlier_salient = 0;  // bit j: token lane + 32 j
  int candidates = 1;
#pragma unroll
  for (int j = 0; j < kMaxTokensALane; ++j) {
    const int t = lane + 32 * j;
    slot[j] = t < B ? slot_of[t] : kNoSlot;
    const bool salient = t < off && slot[j] != kNoSlot;
    earlier_salient |= unsigned(salient) << j;
    candidates += __popc(__ballot_sync(kAll, salient));
  }

  const T* k_src = static_cast<const T*>(a.key) + i * a.k_row_stride + h * D;
  // the choice: every candidate where the quota takes them all (a decoded token held while its block
  // has a free slot), else the best-scored up to the quota
  unsigned keep = earlier_salient | (unsigned(lane == off % 32) << (off / 32));  // bit j: token lane + 32 j
  if (quota < candidates) {
    kvc::wait_for_prior_grid();  // the log-sum-exps (or drawn scores), from the kernels before
    float score[kMaxTokensALane];
    if (a.given != nullptr) {
#pragma unroll
      for (int j = 0; j < kMaxTokensALane; ++j) {
        const int t = lane + 32 * j;
        score[j] = t < B ? static_cast<const float*>(a.given)[(int64_t(i) * B + t) * H + h] : 0.f;
      }
    } else {
#pragma unroll
      for (int j = 0; j < kMaxTokensALane; ++j) score[j] = 0.f;  // tokens past the new one
      const int first_seen = length - 1 - off, seen_from = length - a.window;  // block start; the window's
      // logit = scale (sum_c q_c step_c level_c + sum_c q_c zero_c) on the stored grid; the new token's
      // from its values. For each query head g of the KV head (its probe: the row's query of head
      // h * group + g), q times the channels' steps goes to shared memory, where the lanes read the
      // same channels at once (a broadcast) as each scores its own tokens. The stored grid and new
      // values are loaded here and again for the grids below (L1 hits): held across the scoring they
      // took the kernel past its 80 registers.
      float* q_steps = probe_shared + warp * probe_floats(a.group, D);
      float4* terms = reinterpret_cast<float4*>(q_steps + a.group * D);  // bias, middle, lse, new token's logit
      write_probes<D, BYTES>(q_steps, terms, static_cast<const T*>(a.query) + i * a.q_row_stride, a.q_head_stride,
                             static_cast<const float*>(a.lse) + i * a.lse_row_stride, a.lse_head_stride, page,
                             a.k_scale, a.k_zero, k_src, h, a.group, lane);
#pragma unroll
      for (int j = 0; j < kMaxTokensALane; ++j) {
        if (32 * j > off) continue;  // (not break: the loop unrolls, the arrays stay in registers)
        const int t = lane + 32 * j;
        const bool seen = t <= off && first_seen + t >= seen_from;
        if (!seen) continue;
        float sum = 0.f;  // the probabilities the KV head's query heads give the token
        if (t < off) {
          const bool refined = slot[j] != int(kNoSlot);
          const uint8_t* high_at = page + a.k_high + (int64_t(h) * B + t) * U;
          const uint8_t* low_at = refined ? page + a.k_low + (int64_t(h) * R + slot[j]) * U : nullptr;
          for (int g = 0; g < a.group; ++g) {  // the rows loaded again for each head (L1 hits): held, they spilled
            uint4 high[D / 64], low[D / 64];
            load_row<D>(high, high_at);
            load_row<D>(low, low_at);
            const float4 tg = terms[g];
            const float logit = stored_logit<D>(high, low, q_steps + g * D) + (refined ? 0.f : tg.y) + tg.x;
            sum += __expf(a.scale * logit - tg.z);
          }
        } else {
          for (int g = 0; g < a.group; ++g) sum += __expf(a.scale * terms[g].w - terms[g].z);
        }
        score[j] = sum;
      }
    }
    const unsigned candidate = keep;
    if (quota == candidates - 1) {  // one to drop (the block's slots full): the least-scored, ties to the later
      float least = INFINITY;
      int dropped = -1;
#pragma unroll
      for (int j = 0; j < kMaxTokensALane; ++j) {
        const int t = lane + 32 * j;
        if (((candidate >> j) & 1) && (score[j] < least || (score[j] == least && t > dropped)))
          least = score[j], dropped = t;
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(kAll, least, o);
        const int other_dropped = __shfl_xor_sync(kAll, dropped, o);
        if (other < least || (other == least && other_dropped > dropped)) least = other, dropped = other_dropped;
      }
      if (dropped % 32 == lane) keep &= ~(1u << (dropped / 32));
    } else {  // a re-compression: a candidate keeps 4 bits if fewer than `quota` are better (ties to the earlier)
#pragma unroll
      for (int j = 0; j < kMaxTokensALane; ++j)  // NaN, never better: not a candidate, or past the block
        s.score[lane + 32 * j] = ((candidate >> j) & 1) ? score[j] : NAN;
      __syncwarp();
      int better[kMaxTokensALane] = {};
      for (int c4 = 0; c4 <= off; c4 += 4) {  // every lane reads the same four scores: a broadcast
        const float4 theirs4 = reinterpret_cast<const float4*>(s.score)[c4 / 4];
        const float theirs[4] = {theirs4.x, theirs4.y, theirs4.z, theirs4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
          for (int j = 0; j < kMaxTokensALane; ++j)
            better[j] += theirs[e] > score[j] || (theirs[e] == score[j] && c4 + e < lane + 32 * j);
      }
#pragma unroll
      for (int j = 0; j < kMaxTokensALane; ++j)
        if (better[j] >= quota) keep &= ~(1u << j);
    }
  }
  float old_zero[BYTES][4], old_step[BYTES][4], zero[BYTES][4], step[BYTES][4];
  unsigned k_code[BYTES];  // the new token's 4-bit codes, channel k in bits 4 k
  const unsigned regridded =  // bit 4 jb + k: the channel takes a new grid (widened, or a block's first token)
      new_token_grids<D>(k_src, page, a.k_zero, a.k_scale, h, off, lane, old_zero, old_step, zero, step, k_code);

  const bool keep_new = (__shfl_sync(kAll, keep, off % 32) >> (off / 32)) & 1;

  // a widened channel's earlier codes, mapped through its tables (the level's value on the stored
  // grid coded on the new one, with the reference's arithmetic); a lane a token, the dropped tokens'
  // refinement read before the new token may take their slot
  // Before the first store to the pages: the decode before this may still read them (it attends the
  // new token from its K and V, not from the pages). The reads above (pages, new tokens) do not wait,
  // so the kernel launched right before this one must not write the pages or the new tokens: in
  // serving it is the decode (or its merge of splits), which writes neither.
  kvc::wait_for_prior_grid();
  const bool widened = off > 0 && __any_sync(kAll, regridded != 0);
  if (widened) {
#pragma unroll
    for (int jb = 0; jb < BYTES; ++jb)
      if (lane + 32 * jb < U) s.widened[lane + 32 * jb] = uint8_t((regridded >> (4 * jb)) & 15u);
    // the tables (salient_write_parts.cuh), their grids listed in the scores' place, which the
    // ranking no longer reads
    widened_tables(regridded, old_zero, old_step, zero, step, lane, reinterpret_cast<float4*>(s.score),
                   s.listed_channel, s.refined_table, s.middle_table);
#pragma unroll
    for (int jb = 0; jb < BYTES; ++jb) {
      unsigned bytes = __ballot_sync(kAll, lane + 32 * jb < U && ((regridded >> (4 * jb)) & 15u));
      while (bytes) {
        const int b = 32 * jb + __ffs(bytes) - 1;
        bytes &= bytes - 1;
        const unsigned mask = s.widened[b];
#pragma unroll
        for (int j = 0; j < kMaxTokensALane; ++j) {
          const int t = lane + 32 * j;
          if (t >= off) continue;
          const bool refined = slot[j] != int(kNoSlot);
          uint8_t* high_at = page + a.k_high + (int64_t(h) * B + t) * U + b;
          uint8_t* low_at = page + a.k_low + (int64_t(h) * R + (refined ? slot[j] : 0)) * U + b;
          const unsigned high = *high_at, low = refined ? *low_at : 0u;
          unsigned new_high = high, new_low = low;  // the widened channels' 2-bit fields replaced
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if (!((mask >> k) & 1)) continue;
            const unsigned code =
                refined ? unsigned(s.refined_table[4 * b + k] >> (4 * (4 * code2(high, k) + code2(low, k)))) & 15u
                        : unsigned(s.middle_table[4 * b + k] >> (4 * code2(high, k))) & 15u;
            new_high = (new_high & ~(3u << (2 * k))) | ((code >> 2) << (2 * k));
            new_low = (new_low & ~(3u << (2 * k))) | ((code & 3u) << (2 * k));
          }
          *high_at = uint8_t(new_high);
          if (refined && ((keep >> j) & 1)) *low_at = uint8_t(new_low);
        }
      }
    }
    __syncwarp();
  }

  // the new token's slot: the lowest that no kept earlier token holds
  int new_slot = R;
  if (keep_new) {
    for (int w = 0; w * 32 < R && new_slot == R; ++w) {
      unsigned held = 0;
#pragma unroll
      for (int j = 0; j < kMaxTokensALane; ++j)
        if ((((keep & earlier_salient) >> j) & 1) && (slot[j] >> 5) == w) held |= 1u << (slot[j] & 31);
      held = warp_or(held);
      if (held != kAll) new_slot = min(R, 32 * w + __ffs(~held) - 1);
    }
  }

  // the new token's rows: K on its channels' grids, V on its own grid
  const T* v_src = static_cast<const T*>(a.value) + i * a.v_row_stride + h * D;
  float v[BYTES][4], v_lo = INFINITY, v_hi = -INFINITY;
#pragma unroll
  for (int jb = 0; jb < BYTES; ++jb) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int c = 4 * (lane + 32 * jb) + k;
      v[jb][k] = c < D ? to_float(v_src[c]) : 0.f;
      if (c < D) v_lo = fminf(v_lo, v[jb][k]), v_hi = fmaxf(v_hi, v[jb][k]);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    v_lo = fminf(v_lo, __shfl_xor_sync(kAll, v_lo, o));
    v_hi = fmaxf(v_hi, __shfl_xor_sync(kAll, v_hi, o));
  }
  const float2 v_grid = min_max_stats(v_lo, v_hi, kSalientTop);
#pragma unroll
  for (int jb = 0; jb < BYTES; ++jb) {
    const int b = lane + 32 * jb;
    if (b >= U) continue;
    unsigned k_high = 0, k_low = 0, v_high = 0, v_low = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const unsigned kc = (k_code[jb] >> (4 * k)) & 15u;
      const unsigned vc = clamped_code(v[jb][k], v_grid.x, v_grid.y, kSalientTop);
      k_high |= (kc >> 2) << (2 * k), k_low |= (kc & 3u) << (2 * k);
      v_high |= (vc >> 2) << (2 * k), v_low |= (vc & 3u) << (2 * k);
      if ((regridded >> (4 * jb + k)) & 1) {
        const int c = 4 * b + k;
        store_half(page + a.k_zero + (h * D + c) * 2, zero[jb][k]);
        store_half(page + a.k_scale + (h * D + c) * 2, step[jb][k]);
      }
    }
    page[a.k_high + (int64_t(h) * B + off) * U + b] = uint8_t(k_high);
    page[a.v_high + (int64_t(h) * B + off) * U + b] = uint8_t(v_high);
    if (keep_new) {
      page[a.k_low + (int64_t(h) * R + new_slot) * U + b] = uint8_t(k_low);
      page[a.v_low + (int64_t(h) * R + new_slot) * U + b] = uint8_t(v_low);
    }
  }
  if (lane == 0) {
    store_half(page + a.v_zero + (h * B + off) * 2, v_grid.x);
    store_half(page + a.v_scale + (h * B + off) * 2, v_grid.y);
  }
  // the slot map: the new token's slot; earlier tokens that lost 4 bits, and rows past the new token, none
#pragma unroll
  for (int j = 0; j < kMaxTokensALane; ++j) {
    const int t = lane + 32 * j;
    if (t == off)
      slot_of[t] = uint8_t(keep_new ? new_slot : kNoSlot);
    else if ((t < off && ((earlier_salient & ~keep) >> j) & 1) || (t > off && t < B))
      slot_of[t] = uint8_t(kNoSlot);
  }
}

// The kernel's launch for run_write
struct SlotMapWrite {
  template <typename T, int D>
  static cudaError_t launch(const SalientWriteArgs& a) {
    return launch_write_warps<salient_write_kernel<T, D>, D, sizeof(Scratch<D>) * kWriteWarps>(a);
  }
};

}  // namespace

// Decode rows' new tokens into ZipCache's pages. Returns a cudaError_t (cudaErrorInvalidValue for what
// the kernel does not cover: head sizes but 64, 128 and 256, blocks over 128 tokens, float32, more
// query heads a KV head than kMaxProbeFloats holds).
extern "C" int kvc_salient_write(const SalientWriteArgs* a) {
  return run_write<SlotMapWrite>(*a, a->block_size <= kMaxBlock && a->slots < int(kNoSlot));
}
