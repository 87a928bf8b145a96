// Decode attention of one query token per (request, KV head) over ZipCache's pages (formats/salient.py),
// one query head a KV head (MHA), head size 128, pages of 64 or 128 tokens. Same contract as
// triton_kernels/salient_decode.py's decode rows: each row attends to its history in the pages and to
// its own new token, which the pages take only after attention (the write chooses with the
// probabilities it receives); the kernel leaves the output and the natural log-sum-exp ([head, row]),
// from which the decode write turns the row's logits into its probe's probabilities. The torch
// reference is salient_torch's attention over the decoded pages and the new token.
//
// A token's high plane (2-bit codes, 4 channels a byte, token-major rows [H, BLOCK, 32]) and, for a
// refined token, its slot's row of low bits ([H, SLOTS, 32], slot_of [H, BLOCK]) are joined into
// 4-bit codes: from a word of each, two words of nibbles, channels 4b, 4b + 2 of byte b (even) and
// 4b + 1, 4b + 3 (odd). These enter decode_kernel.cu's 4-bit products (decode_mma.cuh):
// - q.K: the joined K words are the left operand (16 tokens by 16 channels); the sum over channels
//   takes them in the join's order, so the query is permuted to it;
// - p.V: the left operand is V's units by tokens; a byte permute of two tokens' joined words makes a
//   word of two units' bytes of both, which the codes' unpacking splits into the two rows.
// An unrefined token joins low bits 0 and reads 1.5 steps above that (KVC_SALIENT_MIDDLE): its logit
// gains 1.5 sum(q * K scale), its V zero 1.5 times its V scale.
//
// A thread block of 2 warps takes one (row, head, split), the context in slices of 64 tokens as in
// decode_kernel.cu; each warp keeps its own running maximum, sum and output, merged at the end, and
// the next page's slot bytes are loaded a whole slice before its low rows are. The new token joins
// at the end, in split 0 (its logit from the lane's four query channels, its V read as it is).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "decode_mma.cuh"
#include "dependent_launch.cuh"
#include "salient_codes.cuh"
#include "vector_words.cuh"

namespace {

using namespace kvc;

constexpr int kRow = kHead / 4;  // bytes of a token's 2-bit row (high plane or low bits)

struct Regions {  // byte offsets of a page's regions, and its refinement rows a head
  int k_scale, k_zero, v_scale, v_zero, k_high, v_high, k_low, v_low, slot_of, slots;
};

// Byte t of 8 N consecutive ones (one byte permute)
__device__ __forceinline__ uint32_t byte_at(uint32_t w, int t) { return __byte_perm(w, 0, 0x4440 | (t & 3)); }
__device__ __forceinline__ uint32_t byte_at(const uint2& v, int t) { return byte_at(t < 4 ? v.x : v.y, t); }
__device__ __forceinline__ uint32_t byte_at(const uint4& v, int t) { return byte_at(word(v, t >> 2), t); }

// A 64-bit pointer the compiler keeps whole, so that a token's refinement row is one shift-add from
// it rather than the page's sum with the region's offsets redone for each token
__device__ __forceinline__ const uint8_t* whole(const uint8_t* p) {
  asm("" : "+l"(p));
  return p;
}

// The slot bytes of a lane's tokens of a slice: K's 8g..8g+7, V's 16c..16c+15
struct Slots {
  uint2 k;
  uint4 v;
};

template <int BLOCK>
__device__ __forceinline__ Slots load_slots(const uint8_t* page, const Regions& o, int h, int lane, int slice0) {
  const uint8_t* at = page + o.slot_of + h * BLOCK + slice0;
  return {__ldg(reinterpret_cast<const uint2*>(at + 8 * (lane >> 2))), load16(at + 16 * (lane & 3))};
}

// A page's bytes that one lane (g = lane / 4, c = lane % 4) reads for its warp's slice of 64 tokens
struct PageLoads {
  uint2 k_hi[8], k_lo[8];       // K rows' bytes 8c..8c+7 (channels 32c..32c+31) of tokens 8g + t
  uint32_t v_hi[16], v_lo[16];  // V rows' word g (channels 16g..16g+15) of tokens 16c + t
  uint4 ks[2], kz[2];           // K scale, zero of channels 16g..16g+15 (those of the lane's query pair)
  uint4 vs[2], vz[2];           // V scale, zero of tokens 16c..16c+15
};

// A refined token's row of low bits; 0 for the others (slot bytes past the refinement rows: a
// 2-bit token's NO_SLOT, or an unwritten token's bytes, which are never addressed)
__device__ __forceinline__ bool refined(uint32_t slot, int slots) { return slot < uint32_t(slots); }

template <int BLOCK>
__device__ __forceinline__ void load_k(PageLoads& in, const uint2& slot_bytes, const uint8_t* page, const Regions& o,
                                       int h, int lane, int slice0) {
  const int g = lane >> 2, c = lane & 3;
  const uint8_t* high = page + o.k_high + (size_t(h) * BLOCK + slice0 + 8 * g) * kRow + 8 * c;
  const uint8_t* low = whole(page + o.k_low + size_t(h) * o.slots * kRow + 8 * c);
  // what does not wait for the slot bytes first
#pragma unroll
  for (int t = 0; t < 8; ++t) in.k_hi[t] = __ldg(reinterpret_cast<const uint2*>(high + t * kRow));
  const uint8_t* stats = page + (h * kHead + 16 * g) * 2;
  in.ks[0] = load16(stats + o.k_scale);
  in.ks[1] = load16(stats + o.k_scale + 16);
  in.kz[0] = load16(stats + o.k_zero);
  in.kz[1] = load16(stats + o.k_zero + 16);
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const uint32_t s = byte_at(slot_bytes, t);
    in.k_lo[t] = refined(s, o.slots) ? __ldg(reinterpret_cast<const uint2*>(low + s * kRow)) : make_uint2(0, 0);
  }
}

template <int BLOCK>
__device__ __forceinline__ void load_v(PageLoads& in, const uint4& slot_bytes, const uint8_t* page, const Regions& o,
                                       int h, int lane, int slice0) {
  const int g = lane >> 2, c = lane & 3;
  const uint8_t* high = page + o.v_high + (size_t(h) * BLOCK + slice0 + 16 * c) * kRow + 4 * g;
  const uint8_t* low = whole(page + o.v_low + size_t(h) * o.slots * kRow + 4 * g);
#pragma unroll
  for (int t = 0; t < 16; ++t) in.v_hi[t] = __ldg(reinterpret_cast<const uint32_t*>(high + t * kRow));
  const uint8_t* stats = page + (h * BLOCK + slice0 + 16 * c) * 2;
  in.vs[0] = load16(stats + o.v_scale);
  in.vs[1] = load16(stats + o.v_scale + 16);
  in.vz[0] = load16(stats + o.v_zero);
  in.vz[1] = load16(stats + o.v_zero + 16);
#pragma unroll
  for (int t = 0; t < 16; ++t) {
    const uint32_t s = byte_at(slot_bytes, t);
    in.v_lo[t] = refined(s, o.slots) ? __ldg(reinterpret_cast<const uint32_t*>(low + s * kRow)) : 0u;
  }
}

// q.K of the warp's slice: s[i][0] of token 8g + i (product row g), s[i][2] of token 8g + 4 + i (row
// g + 8). k-step (j, plane P) takes joined word j of the lane's quarter row: j = 2w + odd from high
// and low words w, whose byte b holds channels 32c + 16w + 4b + 2P + odd; the query operand qa (bytes
// 0, 2) and qb (bytes 1, 3) is in that order.
__device__ __forceinline__ void logits(float (&s)[4][4], const PageLoads& in, const uint32_t (&qa)[4][2],
                                       const uint32_t (&qb)[4][2]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int r = 0; r < 4; ++r) s[i][r] = 0.f;
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const uint32_t h0 = w ? in.k_hi[i].y : in.k_hi[i].x, l0 = w ? in.k_lo[i].y : in.k_lo[i].x;  // row g
      const uint32_t h1 = w ? in.k_hi[i + 4].y : in.k_hi[i + 4].x, l1 = w ? in.k_lo[i + 4].y : in.k_lo[i + 4].x;
      const uint32_t e0 = join_even(h0, l0), e1 = join_even(h1, l1);
      mma_codes<4, 0>(s[i], e0, e1, qa[2 * w][0], qb[2 * w][0]);
      mma_codes<4, 1>(s[i], e0, e1, qa[2 * w][1], qb[2 * w][1]);
      const uint32_t d0 = join_odd(h0, l0), d1 = join_odd(h1, l1);
      mma_codes<4, 0>(s[i], d0, d1, qa[2 * w + 1][0], qb[2 * w + 1][0]);
      mma_codes<4, 1>(s[i], d0, d1, qa[2 * w + 1][1], qb[2 * w + 1][1]);
    }
  }
}

// acc[tile][plane] += V's joined codes . p over the slice's 4 k-steps; k-step st takes tokens 16c +
// 4st + (0, 1) (pa) and + (2, 3) (pb). Tile 2 odd + half holds, in rows g and g + 8, bytes 2 half and
// 2 half + 1 of the lane's joined word (even or odd): channels 16g + 4b + 2P + odd of plane P.
__device__ __forceinline__ void weighted_values(float (&acc)[4][2][4], const PageLoads& in, const uint32_t (&pa)[4],
                                                const uint32_t (&pb)[4]) {
#pragma unroll
  for (int st = 0; st < 4; ++st) {
    uint32_t joined[2][4];  // [odd][token 4st + e]
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      joined[0][e] = join_even(in.v_hi[4 * st + e], in.v_lo[4 * st + e]);
      joined[1][e] = join_odd(in.v_hi[4 * st + e], in.v_lo[4 * st + e]);
    }
#pragma unroll
    for (int tile = 0; tile < 4; ++tile) {
      const uint32_t sel = (tile & 1) ? 0x7632 : 0x5410;  // bytes (2 half, 2 half + 1) of two tokens' words
      const uint32_t* j = joined[tile >> 1];
      const uint32_t x = __byte_perm(j[0], j[1], sel), y = __byte_perm(j[2], j[3], sel);
      mma(acc[tile][0], codes<4, 0>(x), codes<4, 0>(x >> 8), codes<4, 0>(y), codes<4, 0>(y >> 8), pa[st], pb[st]);
      mma(acc[tile][1], codes<4, 1>(x), codes<4, 1>(x >> 8), codes<4, 1>(y), codes<4, 1>(y >> 8), pa[st], pb[st]);
    }
  }
}

// Channel of tile `tile`, plane `plane`, accumulator register r (0: row g, 2: row g + 8)
__device__ __forceinline__ int channel(int g, int tile, int plane, int r) {
  return 16 * g + 4 * (2 * (tile & 1) + r / 2) + 2 * plane + (tile >> 1);
}

template <int BLOCK, typename T>
__global__ void __launch_bounds__(kWarps * 32) salient_decode(
    const T* __restrict__ query, const uint8_t* __restrict__ cache, const int32_t* __restrict__ block_table,
    const int32_t* __restrict__ seq_lens, const int32_t* __restrict__ row_order, const T* __restrict__ key,
    const T* __restrict__ value, T* __restrict__ out, float* __restrict__ part, float* __restrict__ lse,
    float q_scale, int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t out_stride, int64_t bt_stride, int64_t page_bytes,
    int64_t lse_stride, int blocks_per_split, int num_splits, int table_blocks, int num_heads, Regions o) {
  __shared__ float4 probs[kWarps][kSlice / 4];  // a warp's probabilities, from the logits' lanes to the products'
  __shared__ float other_out[kHead];            // warp 1's output, merged by warp 0
  __shared__ float other_ml[2];
  kvc::allow_next_grid();  // the merge of the splits may be scheduled
  // (the set-up of decode_kernel.cu's kernels, each computing it itself: see decode_gqa)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int h = blockIdx.x % num_heads;
  const int row = row_order != nullptr ? row_order[blockIdx.x / num_heads] : blockIdx.x / num_heads;
  const int split = blockIdx.y;
  const int b_start = split * blocks_per_split;
  using S = WarpSlices<BLOCK>;
  const int b_first = S::first_page(b_start, warp), slice0 = S::slice0(warp);
  const int32_t* table = block_table + row * bt_stride;
  const int first_entry = first_table_entry(table, b_first, table_blocks);  // beside L, not after it
  const int L = seq_lens[row];
  const int b_end = min(b_start + blocks_per_split, (L + BLOCK - 1) / BLOCK);
  kvc::wait_for_prior_grid();  // the kernels before: the query and new K, V after this

  // This lane scales the query pair of k-step (j, plane P) of lane c' where lane = 8c' + 2j + P: x
  // of channels base + (0, 8), y of base + (4, 12), base = 16g + o, o = 2P + c / 2 (logits' order)
  const int plane = c & 1, o_ch = 2 * plane + (c >> 1);
  float qf[4];
  {
    const T* qrow = query + row * q_stride + h * kHead + 16 * g + o_ch;
    const int at[4] = {0, 8, 4, 12};
#pragma unroll
    for (int i = 0; i < 4; ++i) qf[i] = to_float(qrow[at[i]]) * q_scale;
  }
  float own = 0.f;  // the new token's logit (base 2), summed over the warp from the lane's channels
  if (split == 0) {
    const T* krow = key + row * k_stride + h * kHead + 16 * g + o_ch;
    own = qf[0] * to_float(krow[0]) + qf[1] * to_float(krow[8]) + qf[2] * to_float(krow[4]) +
          qf[3] * to_float(krow[12]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) own += __shfl_xor_sync(kAll, own, off);
  }
  const float plane_div = plane ? 1.f / 16.f : 1.f;  // plane 1's codes come times 16
  const uint32_t stat_sel = (o_ch & 1) ? 0x7632 : 0x5410;  // half o % 2 of a word, from two vectors
  const int stat_word = o_ch >> 1;

  float m = -INFINITY, l = 0.f, pz = 0.f;  // running max (base 2); lane partials of sum p, sum p * zero
  float acc[4][2][4] = {};

  PageLoads in;
  Slots slots = {};
  if (b_first < b_end && holds_slice<BLOCK>(b_first, slice0, L)) {
    const uint8_t* page = page_of(cache, first_entry, page_bytes);
    slots = load_slots<BLOCK>(page, o, h, lane, slice0);
    load_k<BLOCK>(in, slots.k, page, o, h, lane, slice0);
    load_v<BLOCK>(in, slots.v, page, o, h, lane, slice0);
  }
  for (int b = b_first; b < b_end; b += S::STEP) {
    if (!holds_slice<BLOCK>(b, slice0, L)) break;  // as decode_kernel.cu's
    const uint8_t* next = b + S::STEP < b_end && holds_slice<BLOCK>(b + S::STEP, slice0, L)
                              ? page_of(cache, table[b + S::STEP], page_bytes)
                              : nullptr;
    Slots next_slots = slots;
    if (next != nullptr) next_slots = load_slots<BLOCK>(next, o, h, lane, slice0);

    // the scaled query in the logits' operand order, K's bias and the middle of an unrefined token
    uint32_t qa[4][2], qb[4][2];
    float bias, middle;
    {
      const uint32_t sx = __byte_perm(word(in.ks[0], stat_word), word(in.ks[1], stat_word), stat_sel);
      const uint32_t sy = __byte_perm(word(in.ks[0], stat_word + 2), word(in.ks[1], stat_word + 2), stat_sel);
      const uint32_t zx = __byte_perm(word(in.kz[0], stat_word), word(in.kz[1], stat_word), stat_sel);
      const uint32_t zy = __byte_perm(word(in.kz[0], stat_word + 2), word(in.kz[1], stat_word + 2), stat_sel);
      const float2 ksx = unpack_half2(sx), ksy = unpack_half2(sy), kzx = unpack_half2(zx), kzy = unpack_half2(zy);
      const uint32_t x = pack_half2(qf[0] * plane_div * ksx.x, qf[1] * plane_div * ksx.y);
      const uint32_t y = pack_half2(qf[2] * plane_div * ksy.x, qf[3] * plane_div * ksy.y);
      const float2 xr = unpack_half2(x), yr = unpack_half2(y);
      bias = qf[0] * kzx.x + qf[1] * kzx.y + qf[2] * kzy.x + qf[3] * kzy.y - 1024.f * ((xr.x + xr.y) + (yr.x + yr.y));
      middle = kSalientMiddle * (qf[0] * ksx.x + qf[1] * ksx.y + qf[2] * ksy.x + qf[3] * ksy.y);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        bias += __shfl_xor_sync(kAll, bias, off);
        middle += __shfl_xor_sync(kAll, middle, off);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int pl = 0; pl < 2; ++pl) {
          const int src = 8 * c + 2 * j + pl;
          qa[j][pl] = __shfl_sync(kAll, x, src);
          qb[j][pl] = __shfl_sync(kAll, y, src);
        }
    }

    float s[4][4];
    logits(s, in, qa, qb);
    if (next != nullptr) load_k<BLOCK>(in, next_slots.k, next, o, h, lane, slice0);  // K's registers are free

    // softmax over the slice: tokens at or past L (on the last page) get no weight
    const int pos = b * BLOCK + slice0;  // position of the slice's token 0
    const bool tail = pos + kSlice > L;    // the same for the whole warp: its masks are a branch
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int r = 0; r < 4; r += 2) {
        const int t = 2 * r + i;  // the token's place among the lane's 8g..8g+7
        s[i][r] += bias + (refined(byte_at(slots.k, t), o.slots) ? 0.f : middle);
      }
    if (tail) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int r = 0; r < 4; r += 2)
          if (pos + 8 * g + 2 * r + i >= L) s[i][r] = -INFINITY;
    }
    float alpha;
    const float m_ref = slice_max(s, m, alpha);
    float pr[16];  // probabilities of tokens 16c..16c+15
    slice_probabilities(probs[warp], s, m_ref, g, c, pr);

    // p * V's token scale as the right operand, and the lane's sums of p, of p times V's zero (an
    // unrefined token's 1.5 steps in it) and of the float16 products
    uint32_t pa[4], pb[4];
    float lsum = 0.f, zsum = 0.f, psum = 0.f;
    {
      float vs[16], vz[16];
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        vs[t] = half_at(in.vs, t);
        vz[t] = half_at(in.vz, t);
      }
      if (tail) {  // an unwritten slot's statistics may be anything
#pragma unroll
        for (int t = 0; t < 16; ++t)
          if (pos + 16 * c + t >= L) vs[t] = vz[t] = 0.f;
      }
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        if (!refined(byte_at(slots.v, t), o.slots)) vz[t] += kSalientMiddle * vs[t];
        lsum += pr[t];
        zsum += pr[t] * vz[t];
        pr[t] *= vs[t];
      }
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        pa[st] = pack_half2(pr[4 * st], pr[4 * st + 1]);
        pb[st] = pack_half2(pr[4 * st + 2], pr[4 * st + 3]);
        const float2 ra = unpack_half2(pa[st]), rb = unpack_half2(pb[st]);
        psum += (ra.x + ra.y) + (rb.x + rb.y);
      }
    }
    l = l * alpha + lsum;
    pz = pz * alpha + zsum;
    psum += __shfl_xor_sync(kAll, psum, 1);
    psum += __shfl_xor_sync(kAll, psum, 2);
    const float offset = 1024.f * psum;  // what the codes' 1024 adds to every channel

#pragma unroll
    for (int tile = 0; tile < 4; ++tile)
#pragma unroll
      for (int pl = 0; pl < 2; ++pl) {
        acc[tile][pl][0] = fmaf(acc[tile][pl][0], alpha, -offset);
        acc[tile][pl][2] = fmaf(acc[tile][pl][2], alpha, -offset);
      }
    weighted_values(acc, in, pa, pb);
    if (next != nullptr) load_v<BLOCK>(in, next_slots.v, next, o, h, lane, slice0);
    slots = next_slots;
  }

  // lane partials -> the warp's (lanes of one g hold its 64 tokens); then the warps merged
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l += __shfl_xor_sync(kAll, l, off);
    pz += __shfl_xor_sync(kAll, pz, off);
  }
  if (warp == 1 && c == 0) {
#pragma unroll
    for (int tile = 0; tile < 4; ++tile)
#pragma unroll
      for (int pl = 0; pl < 2; ++pl)
#pragma unroll
        for (int r = 0; r < 4; r += 2)
          other_out[channel(g, tile, pl, r)] = acc[tile][pl][r] * (pl ? 1.f / 16.f : 1.f) + pz;
    if (g == 0) {
      other_ml[0] = m;
      other_ml[1] = l;
    }
  }
  __syncthreads();
  if (warp != 0 || c != 0) return;
  const OwnTokenOutput<T> result(m, l, other_ml[0], other_ml[1], own, split, num_splits,
                                 value + row * v_stride + h * kHead, out + row * out_stride + h * kHead,
                                 part + ((int64_t(row) * num_heads + h) * num_splits + split) * (kHead + 2));
#pragma unroll
  for (int tile = 0; tile < 4; ++tile)
#pragma unroll
    for (int pl = 0; pl < 2; ++pl)
#pragma unroll
      for (int r = 0; r < 4; r += 2) {
        const int ch = channel(g, tile, pl, r);
        result.put(ch, acc[tile][pl][r] * (pl ? 1.f / 16.f : 1.f) + pz, other_out[ch]);
      }
  if (g == 0) result.finish(lse + h * lse_stride + row);
}

}  // namespace

// A decode's arguments, one struct so that the caller (ctypes) converts one pointer a call;
// cuda_salient_decode.py's _SalientDecodeArgs mirrors it field for field.
struct SalientDecodeArgs {
  const void* query;        // [num_rows, heads, 128] rows q_stride elements apart
  const void* cache;        // [num_blocks, page_bytes] uint8
  const void* block_table;  // [num_rows, ...] int32, rows bt_stride apart
  const void* seq_lens;     // [num_rows] int32: each row's history (its context before the new token)
  const void* row_order;    // [num_rows] int32 or null: the order in which rows take blocks
  const void* key;          // [num_rows, heads, 128] the rows' new K, rows k_stride elements apart
  const void* value;        // their new V, rows v_stride elements apart
  void* out;                // rows out_stride elements apart
  void* part;               // [num_rows, heads, num_splits, 130] float32 where num_splits > 1
  void* lse;                // [heads, num_rows] float32, heads lse_stride apart: natural log-sum-exp
  float q_scale;
  int64_t q_stride, k_stride, v_stride, out_stride, bt_stride, page_bytes, lse_stride;
  int blocks_per_split, num_splits;
  int table_blocks;  // the block-table entries a row may be read at (the pages of max_seq_len)
  int num_rows, num_heads;
  int k_scale, k_zero, v_scale, v_zero, k_high, v_high, k_low, v_low, slot_of;  // byte offsets of a page's regions
  int slots;       // refinement rows a head
  int block_size;  // 64 or 128 tokens
  int bf16;        // queries in bfloat16 (else float16)
  void* stream;    // a cudaStream_t
};

template <int BLOCK, typename T>
static cudaError_t launch(const SalientDecodeArgs& a) {
  const Regions o{a.k_scale, a.k_zero, a.v_scale, a.v_zero, a.k_high, a.v_high, a.k_low, a.v_low, a.slot_of, a.slots};
  return launch_own_token_decode<T>(salient_decode<BLOCK, T>, a, o);
}

// Launches on `stream` the decode and, where num_splits > 1, the merge of the splits' partials. Returns the launch's cudaError_t (cudaErrorInvalidValue for other page
// sizes).
extern "C" int kvc_salient_decode(const SalientDecodeArgs* a) {
  using Launcher = cudaError_t (*)(const SalientDecodeArgs&);
  const Launcher f = a->block_size == 128 ? (a->bf16 ? launch<128, __nv_bfloat16> : launch<128, __half>)
                     : a->block_size == 64 ? (a->bf16 ? launch<64, __nv_bfloat16> : launch<64, __half>)
                                           : nullptr;
  return static_cast<int>(f == nullptr ? cudaErrorInvalidValue : f(*a));
}
