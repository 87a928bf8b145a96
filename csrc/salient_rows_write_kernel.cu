// ZipCache's decode write over split-row pages (formats/salient_rows.py): each decode row's new token
// into the last block of its request, with the block's choice of 4-bit tokens. The rules, and so the
// tokens every page reads as, are salient_torch.write_decoded's over the slot-map page (the reference,
// through SalientRowsFormat.to_slot_map / from_slot_map); which row a token takes is this kernel's:
// - a block's 4-bit tokens are the rows of its 4-bit half (whole 4-bit codes), the others rows of its
//   2-bit half (the top two bits), place_of [H, B] a row's place in the block (EMPTY: none);
// - the choice: where the quota does not take every candidate (the 4-bit rows' tokens and the new
//   one), the probe scores the 4-bit rows (their codes as they are, no planes to join), then the
//   least-scored candidate drops to 2 bits (the block's 4-bit half full) or every candidate is ranked
//   (a re-compression); a dropped token's row moves to the lowest free row of the 2-bit half (its
//   codes' top two bits, its V statistics);
// - K's grid per channel: kept, or widened (the 4-bit codec's append rule, min_max_grid.cuh), and a
//   widened channel's earlier codes mapped through tables of new code by old level in both halves;
// - the new token takes the lowest free row of the half of its precision.
// One warp per (decode row, KV head): lane l holds channels 4 l .. 4 l + 3 (and + 128 at head size
// 256) for the grids and codes, and rows l, l + 32 of each half for the choice. Pages of 64 or 128
// tokens (halves of 32 or 64 rows, V's rows in groups of 32), head sizes 64, 128, 256.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "dependent_launch.cuh"
#include "min_max_grid.cuh"
#include "salient_write_parts.cuh"
#include "vector_words.cuh"

#if !defined(KVC_TOKEN_GROUP) || !defined(KVC_EMPTY_ROW)
#error "build through vllm_kvcompress.cuda_jit, which passes the formats' constants"
#endif

namespace {

using namespace kvc;
constexpr unsigned kAll = 0xffffffffu;
constexpr int kMaxRows = 64;               // rows a half (pages of 128 tokens), 2 a lane
constexpr int kRowsALane = kMaxRows / 32;
constexpr int kGroup = KVC_TOKEN_GROUP;    // V rows whose codes of one byte lie together
constexpr int kEmpty = KVC_EMPTY_ROW;      // place_of of a row without a token

}  // namespace

// A launch's arguments; cuda_salient_rows_write.py's _SalientRowsWriteArgs mirrors it field for field.
struct SalientRowsWriteArgs {
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
  int num_rows, num_heads, head_size, block_size;
  int k_scale, k_zero, k4, v4, v4_scale, v4_zero, k2, v2, v2_scale, v2_zero, place_of;  // byte offsets
  int interval;  // a re-compression every `interval` tokens of context
  int window;    // the probe sees the tokens of its last `window` positions
  float scale;   // the softmax scale
  int dtype;     // of query, key and value: 1 float16, 2 bfloat16
  int group;     // query heads a KV head
  void* stream;  // a cudaStream_t
};

namespace {

// A warp's scratch
template <int D>
struct alignas(16) Scratch {
  float score[kMaxRows + 1];           // a candidate's score by 4-bit row (the new token last)
  int place[kMaxRows + 1];             // a candidate's place in the block (-1: not a candidate)
  float4 listed_grid[32];              // a table round's channels' grids (old zero, old step, zero, step)
  unsigned long long refined_table[D];  // a widened channel's new code by old 4-bit code, 4 bits each
  unsigned middle_table[D];            // by a 2-bit row's code h (level 4 h + middle)
  uint16_t listed_channel[32];
  uint8_t dropped[kMaxRows];           // 4-bit rows that lose 4 bits, listed
  uint8_t free2[kMaxRows];             // 2-bit rows without a token, lowest first
};

// Byte u of V row r of a half (rows in groups of kGroup, byte-major within a group; U bytes a row)
__device__ __forceinline__ int64_t v_unit(int h, int rows, int U, int r, int u) {
  return ((int64_t(h) * (rows / kGroup) + r / kGroup) * U + u) * kGroup + r % kGroup;
}

// Four channels' 4-bit codes (nibbles 0..3) as their top two bits, a 2-bit row's byte
__device__ __forceinline__ unsigned top_bits(unsigned codes4) {
  unsigned out = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) out |= ((codes4 >> (4 * k + 2)) & 3u) << (2 * k);
  return out;
}

template <typename T, int D>
__global__ void __launch_bounds__(kWriteWarps * 32, 6) salient_rows_write_kernel(const SalientRowsWriteArgs a) {
  constexpr int U4 = D / 2, U2 = D / 4;  // bytes of a 4-bit row, of a 2-bit row
  constexpr int GROUPS = (U2 + 31) / 32;  // a lane's groups of 4 channels
  __shared__ Scratch<D> scratch[kWriteWarps];
  extern __shared__ float4 probe_shared_vectors[];
  float* probe_shared = reinterpret_cast<float*>(probe_shared_vectors);
  kvc::allow_next_grid();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int item = blockIdx.x * kWriteWarps + warp;
  if (item >= a.num_rows * a.num_heads) return;
  Scratch<D>& s = scratch[warp];
  const int i = item / a.num_heads, h = item % a.num_heads, H = a.num_heads, B = a.block_size, R = B / 2;
  const int length = static_cast<const int32_t*>(a.seq_lens)[i];
  if (length == 0) return;  // a full CUDA graph's padding row
  const int off = (length - 1) % B;  // the new token's place, after `off` stored tokens
  const int64_t block = static_cast<const int32_t*>(a.block_table)[i * a.table_stride + (length - 1) / B];
  const int quota = length % a.interval != 0 ? R : static_cast<const int32_t*>(a.quotas)[off + 1];
  uint8_t* page = static_cast<uint8_t*>(a.cache) + block * a.page_bytes;
  uint8_t* place_of = page + a.place_of + h * B;
  uint8_t* k4 = page + a.k4 + int64_t(h) * R * U4;
  uint8_t* k2 = page + a.k2 + int64_t(h) * R * U2;

  // the lane's rows of each half: their tokens' places (a block's first token finds none: a page
  // reused from an earlier request may hold its places)
  int place4[kRowsALane], place2[kRowsALane];
  unsigned held4 = 0, held2 = 0;  // bit j: row lane + 32 j holds a token
  int candidates = 1;
#pragma unroll
  for (int j = 0; j < kRowsALane; ++j) {
    const int r = lane + 32 * j;
    place4[j] = r < R ? place_of[r] : kEmpty;
    place2[j] = r < R ? place_of[R + r] : kEmpty;
    held4 |= unsigned(place4[j] < off) << j;
    held2 |= unsigned(place2[j] < off) << j;
    candidates += __popc(__ballot_sync(kAll, place4[j] < off));
  }

  const T* k_src = static_cast<const T*>(a.key) + i * a.k_row_stride + h * D;
  unsigned keep4 = held4;  // bit j: row lane + 32 j keeps 4 bits
  bool keep_new = true;
  bool waited = false;
  if (quota < candidates) {
    kvc::wait_for_prior_grid();  // the log-sum-exps (or drawn scores), from the kernels before
    waited = true;
    float score[kRowsALane] = {}, new_score = 0.f;
    const int first_seen = length - 1 - off, seen_from = length - a.window;
    if (a.given != nullptr) {
      const float* given = static_cast<const float*>(a.given) + int64_t(i) * B * H + h;
#pragma unroll
      for (int j = 0; j < kRowsALane; ++j)
        if ((held4 >> j) & 1) score[j] = given[place4[j] * H];
      new_score = given[off * H];
    } else {
      float* q_steps = probe_shared + warp * probe_floats(a.group, D);
      float4* terms = reinterpret_cast<float4*>(q_steps + a.group * D);  // bias, middle, lse, new token's logit
      write_probes<D, GROUPS>(q_steps, terms, static_cast<const T*>(a.query) + i * a.q_row_stride, a.q_head_stride,
                              static_cast<const float*>(a.lse) + i * a.lse_row_stride, a.lse_head_stride, page,
                              a.k_scale, a.k_zero, k_src, h, a.group, lane);
#pragma unroll
      for (int j = 0; j < kRowsALane; ++j) {
        if (!((held4 >> j) & 1) || first_seen + place4[j] < seen_from) continue;
        // the row's 4-bit codes (channel 2 b in the low nibble of byte b), 16 bytes at a time, loaded
        // again for each query head (L1 hits): held whole, they spilled
        const uint8_t* at = k4 + (lane + 32 * j) * U4;
        for (int g = 0; g < a.group; ++g) {
          float logit = 0.f;
#pragma unroll 2
          for (int v = 0; v < D / 32; ++v) {
            const uint4 codes = *reinterpret_cast<const uint4*>(at + 16 * v);
#pragma unroll
            for (int w = 0; w < 4; ++w) {
              const uint32_t x = word(codes, w);  // channels 8 (4 v + w) .. + 7
              const float4* q = reinterpret_cast<const float4*>(q_steps + g * D + 8 * (4 * v + w));
              const float4 lo = q[0], hi = q[1];
              logit += lo.x * nibble(x, 0) + lo.y * nibble(x, 1) + lo.z * nibble(x, 2) + lo.w * nibble(x, 3) +
                       hi.x * nibble(x, 4) + hi.y * nibble(x, 5) + hi.z * nibble(x, 6) + hi.w * nibble(x, 7);
            }
          }
          const float4 tg = terms[g];
          score[j] += __expf(a.scale * (logit + tg.x) - tg.z);
        }
      }
      for (int g = 0; g < a.group; ++g) new_score += __expf(a.scale * terms[g].w - terms[g].z);
    }
    if (quota == candidates - 1) {  // one to drop (the 4-bit half full): the least-scored, ties to the later
      float least = new_score;
      int dropped_place = off;  // the new token: the latest
#pragma unroll
      for (int j = 0; j < kRowsALane; ++j)
        if (((held4 >> j) & 1) && (score[j] < least || (score[j] == least && place4[j] > dropped_place)))
          least = score[j], dropped_place = place4[j];
      for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(kAll, least, o);
        const int other_place = __shfl_xor_sync(kAll, dropped_place, o);
        if (other < least || (other == least && other_place > dropped_place)) least = other, dropped_place = other_place;
      }
      keep_new = dropped_place != off;
#pragma unroll
      for (int j = 0; j < kRowsALane; ++j)
        if (((held4 >> j) & 1) && place4[j] == dropped_place) keep4 &= ~(1u << j);
    } else {  // a re-compression: a candidate keeps 4 bits if fewer than `quota` are better (ties to the earlier)
#pragma unroll
      for (int j = 0; j < kRowsALane; ++j) {
        const int r = lane + 32 * j;
        if (r < R) {
          s.score[r] = score[j];
          s.place[r] = ((held4 >> j) & 1) ? place4[j] : -1;
        }
      }
      if (lane == 0) s.score[R] = new_score, s.place[R] = off;
      __syncwarp();
      int better[kRowsALane] = {}, better_new = 0;
      for (int r = 0; r <= R; ++r) {  // every lane reads the same entry: a broadcast
        const float theirs = s.score[r];
        const int their_place = s.place[r];
        if (their_place < 0) continue;
#pragma unroll
        for (int j = 0; j < kRowsALane; ++j)
          better[j] += theirs > score[j] || (theirs == score[j] && their_place < place4[j]);
        better_new += theirs > new_score || (theirs == new_score && their_place < off);
      }
#pragma unroll
      for (int j = 0; j < kRowsALane; ++j)
        if (better[j] >= quota) keep4 &= ~(1u << j);
      keep_new = better_new < quota;
    }
  }

  // K's grids for the new token, and its 4-bit codes (salient_write_parts.cuh)
  float old_zero[GROUPS][4], old_step[GROUPS][4], zero[GROUPS][4], step[GROUPS][4];
  unsigned k_code[GROUPS];
  const unsigned regridded =
      new_token_grids<D>(k_src, page, a.k_zero, a.k_scale, h, off, lane, old_zero, old_step, zero, step, k_code);

  // Before the first store to the pages: the decode before this may still read them (the kernel
  // launched right before must not write the pages or the new tokens: in serving, the decode)
  if (!waited) kvc::wait_for_prior_grid();
  if (off > 0 && __any_sync(kAll, regridded != 0)) {
    widened_tables(regridded, old_zero, old_step, zero, step, lane, s.listed_grid, s.listed_channel,
                   s.refined_table, s.middle_table);
    // the widened groups' earlier codes, a group of the warp at a time, each lane on its rows
#pragma unroll
    for (int jb = 0; jb < GROUPS; ++jb) {
      unsigned groups = __ballot_sync(kAll, ((regridded >> (4 * jb)) & 15u) != 0);
      while (groups) {
        const int owner = __ffs(groups) - 1;
        groups &= groups - 1;
        const int cg = owner + 32 * jb;  // channels 4 cg .. 4 cg + 3
        const unsigned mask = __shfl_sync(kAll, (regridded >> (4 * jb)) & 15u, owner);
#pragma unroll
        for (int j = 0; j < kRowsALane; ++j) {
          const int r = lane + 32 * j;
          if ((held4 >> j) & 1) {
            uint16_t* at = reinterpret_cast<uint16_t*>(k4 + r * U4 + 2 * cg);
            unsigned codes = *at;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              if (!((mask >> k) & 1)) continue;
              const unsigned old = (codes >> (4 * k)) & 15u;
              const unsigned code = unsigned(s.refined_table[4 * cg + k] >> (4 * old)) & 15u;
              codes = (codes & ~(15u << (4 * k))) | (code << (4 * k));
            }
            *at = uint16_t(codes);
          }
          if ((held2 >> j) & 1) {
            uint8_t* at = k2 + r * U2 + cg;
            unsigned codes = *at;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              if (!((mask >> k) & 1)) continue;
              const unsigned old = (codes >> (2 * k)) & 3u;
              const unsigned code = (s.middle_table[4 * cg + k] >> (4 * old)) & 15u;
              codes = (codes & ~(3u << (2 * k))) | ((code >> 2) << (2 * k));
            }
            *at = uint8_t(codes);
          }
        }
      }
    }
    __syncwarp();
  }

  // the rows that lose 4 bits, listed, and the 2-bit half's free rows, lowest first
  int drops = 0, free_rows = 0;
#pragma unroll
  for (int j = 0; j < kRowsALane; ++j) {
    const int r = lane + 32 * j;
    const bool drop = ((held4 & ~keep4) >> j) & 1;
    const unsigned dropping = __ballot_sync(kAll, drop);
    if (drop) s.dropped[drops + __popc(dropping & ((1u << lane) - 1u))] = uint8_t(r);
    drops += __popc(dropping);
    const bool empty = r < R && !((held2 >> j) & 1);
    const unsigned emptying = __ballot_sync(kAll, empty);
    if (empty) s.free2[free_rows + __popc(emptying & ((1u << lane) - 1u))] = uint8_t(r);
    free_rows += __popc(emptying);
  }
  __syncwarp();
  uint8_t* v4 = page + a.v4;
  uint8_t* v2 = page + a.v2;
  // each dropped row into a free 2-bit row: K's and V's top two bits, V's statistics, its place
  for (int d = 0; d < drops; ++d) {
    const int from = s.dropped[d], to = s.free2[d];
#pragma unroll
    for (int jb = 0; jb < GROUPS; ++jb) {
      const int cg = lane + 32 * jb;
      if (cg >= U2) continue;
      const unsigned kc = *reinterpret_cast<const uint16_t*>(k4 + from * U4 + 2 * cg);
      k2[to * U2 + cg] = uint8_t(top_bits(kc));
      const unsigned vc = v4[v_unit(h, R, U4, from, 2 * cg)] | (unsigned(v4[v_unit(h, R, U4, from, 2 * cg + 1)]) << 8);
      v2[v_unit(h, R, U2, to, cg)] = uint8_t(top_bits(vc));
    }
    if (lane == 0) {
      *reinterpret_cast<__half*>(page + a.v2_scale + (h * R + to) * 2) =
          *reinterpret_cast<const __half*>(page + a.v4_scale + (h * R + from) * 2);
      *reinterpret_cast<__half*>(page + a.v2_zero + (h * R + to) * 2) =
          *reinterpret_cast<const __half*>(page + a.v4_zero + (h * R + from) * 2);
      place_of[R + to] = place_of[from];
      place_of[from] = uint8_t(kEmpty);
    }
  }
  __syncwarp();

  // the new token's row: the lowest free one of its precision's half
  int new_row;
  if (keep_new) {
    new_row = R;
#pragma unroll
    for (int j = 0; j < kRowsALane; ++j) {
      const unsigned taken = __ballot_sync(kAll, lane + 32 * j < R && ((held4 & keep4) >> j) & 1);
      const unsigned exists = j == kRowsALane - 1 && R < 32 * kRowsALane ? (1u << (R - 32 * j)) - 1u : kAll;
      const unsigned free4 = ~taken & exists;
      if (new_row == R && free4) new_row = 32 * j + __ffs(free4) - 1;
    }
  } else {
    new_row = s.free2[drops];  // past the rows the dropped tokens took
  }

  // the new token's codes: K on its channels' grids, V on its own grid
  const T* v_src = static_cast<const T*>(a.value) + i * a.v_row_stride + h * D;
  float v[GROUPS][4], v_lo = INFINITY, v_hi = -INFINITY;
#pragma unroll
  for (int jb = 0; jb < GROUPS; ++jb)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int c = 4 * (lane + 32 * jb) + k;
      v[jb][k] = c < D ? to_float(v_src[c]) : 0.f;
      if (c < D) v_lo = fminf(v_lo, v[jb][k]), v_hi = fmaxf(v_hi, v[jb][k]);
    }
  for (int o = 16; o > 0; o >>= 1) {
    v_lo = fminf(v_lo, __shfl_xor_sync(kAll, v_lo, o));
    v_hi = fmaxf(v_hi, __shfl_xor_sync(kAll, v_hi, o));
  }
  const float2 v_grid = min_max_stats(v_lo, v_hi, kSalientTop);
#pragma unroll
  for (int jb = 0; jb < GROUPS; ++jb) {
    const int cg = lane + 32 * jb;
    if (cg >= U2) continue;
    unsigned vc = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      vc |= clamped_code(v[jb][k], v_grid.x, v_grid.y, kSalientTop) << (4 * k);
      if ((regridded >> (4 * jb + k)) & 1) {
        store_half(page + a.k_zero + (h * D + 4 * cg + k) * 2, zero[jb][k]);
        store_half(page + a.k_scale + (h * D + 4 * cg + k) * 2, step[jb][k]);
      }
    }
    if (keep_new) {
      *reinterpret_cast<uint16_t*>(k4 + new_row * U4 + 2 * cg) = uint16_t(k_code[jb]);
      v4[v_unit(h, R, U4, new_row, 2 * cg)] = uint8_t(vc);
      v4[v_unit(h, R, U4, new_row, 2 * cg + 1)] = uint8_t(vc >> 8);
    } else {
      k2[new_row * U2 + cg] = uint8_t(top_bits(k_code[jb]));
      v2[v_unit(h, R, U2, new_row, cg)] = uint8_t(top_bits(vc));
    }
  }
  if (lane == 0) {
    const int at = keep_new ? new_row : R + new_row;
    store_half(page + (keep_new ? a.v4_zero : a.v2_zero) + (h * R + new_row) * 2, v_grid.x);
    store_half(page + (keep_new ? a.v4_scale : a.v2_scale) + (h * R + new_row) * 2, v_grid.y);
    place_of[at] = uint8_t(off);
  }
  if (off == 0) {  // a block's first token: no other row holds one
#pragma unroll
    for (int j = 0; j < kRowsALane; ++j) {
      const int r = lane + 32 * j;
      if (r < R && !(keep_new && r == new_row)) place_of[r] = uint8_t(kEmpty);
      if (r < R && !(!keep_new && r == new_row)) place_of[R + r] = uint8_t(kEmpty);
    }
  }
}

// The kernel's launch for run_write
struct SplitRowWrite {
  template <typename T, int D>
  static cudaError_t launch(const SalientRowsWriteArgs& a) {
    return launch_write_warps<salient_rows_write_kernel<T, D>, D, sizeof(Scratch<D>) * kWriteWarps>(a);
  }
};

}  // namespace

// Decode rows' new tokens into split-row pages. Returns a cudaError_t (cudaErrorInvalidValue for what
// the kernel does not cover: head sizes but 64, 128 and 256, pages but of 64 and 128 tokens, float32,
// more query heads a KV head than kMaxProbeFloats holds).
extern "C" int kvc_salient_rows_write(const SalientRowsWriteArgs* a) {
  return run_write<SplitRowWrite>(*a, a->block_size == 64 || a->block_size == 128);
}
