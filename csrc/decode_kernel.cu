// Decode attention of one query token per (request, KV head) over 4/4- or 2/2-bit "quant" pages,
// for one, 2 or 4 query heads a KV head, head size 128, pages of 64 or 128 tokens.
// Same contract and outputs as triton_kernels/decode.py's paged_decode (its ungrouped rows,
// with or without row_order and splits); the torch reference is paged_torch.attend.
//
// Why a CUDA kernel: the Triton kernel spends most of a tile's instructions placing unpacked codes
// into the tensor cores' operand registers and working on 16 padded query rows of which one is
// real (docs/benchmarks.md). Here the codes are the products' left operand (16 tokens or channels
// by 16, no padding) and the query or the probabilities the right one, copied to all 8 columns;
// codes go from 8- or 16-byte loads into mma.sync fragments with one shift and one LOP3 per plane
// and half word (a plane: the codes at one bit offset of every byte; 2 planes at 4 bits, 4 at 2).
// The sum over channels (q.K) and over tokens (p.V) does not care in which order its terms come,
// so each product's k axis is permuted to match where the LOP3s leave the codes: bytes (0, 2) and
// (1, 3) of a word, so channels (0, 4), (2, 6) of a 4-bit K word for plane 0, tokens (0, 2), (1, 3)
// of a V word. The query, scaled by K's channel scales once a page, is permuted the same way.
//
// Page format (docs/formats.md): K codes row by row, [H, BLOCK, 16 * BITS bytes], 8 / BITS channels
// a byte (channel j * planes + k in bits k * BITS), scale and zero per channel [H, 128] float16; V
// codes in groups of 32 tokens, unit-major within a group, [H, BLOCK / 32, 16 * BITS units, 32], scale
// and zero per token [H, BLOCK] float16.
// Codes enter the products as float16 1024 + code (OR'd into 1024's mantissa); the offset is taken
// out with sums of the right operand. Logits are in base-2 units (log2(e) folded into the query scale).
//
// A thread block of 2 warps takes one (row, KV head, split); the context is read in slices of 64
// tokens, and warp w takes slices w, w + 2, ...: on 128-token pages tokens 64w..64w+63 of every page
// that holds any of them, on 64-token pages every other page. Each warp keeps its own running
// maximum, sum and output, merged at the end. A split launch's partial outputs are merged by
// merge_splits, launched by the same call.
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

// V codes of a unit's consecutive tokens lie together, KVC_TOKEN_GROUP of them (formats.layout.TOKEN_GROUP,
// passed by cuda_jit at build; the kernel registry refuses pages grouped otherwise)
#ifndef KVC_TOKEN_GROUP
#error "build through vllm_kvcompress.cuda_jit, which passes the page layout's constants"
#endif
constexpr int kTokenGroup = KVC_TOKEN_GROUP;

// What a width of codes changes: planes, bytes of a lane's share of a K row, V's units (m-tiles of 16)
template <int BITS>
struct Geometry {
  static constexpr int kPlanes = 8 / BITS;
  static constexpr int kRow = 16 * BITS;        // bytes of one token's K codes
  static constexpr int kWords = kRow / 16;      // 32-bit words of a lane's quarter of a K row
  static constexpr int kUnits = 16 * BITS;      // V storage units (bytes) a token
  static constexpr int kTiles = kUnits / 16;    // m-tiles of V units
  static constexpr int kStatVecs = kPlanes / 2;  // MHA: 16-byte vectors of a lane's 4 * planes K scales
};

struct Offsets {  // byte offsets of a page's regions
  int k_codes, k_scale, k_zero, v_codes, v_scale, v_zero;
};

// A page's bytes that one lane (g = lane / 4, c = lane % 4) reads, for its warp's slice of 64 tokens.
template <int BITS, int STATS = Geometry<BITS>::kStatVecs>
struct PageLoads {
  using G = Geometry<BITS>;
  uint32_t k[4][2][G::kWords];  // K codes, channels 32c..32c+31, of tokens 8g + i and 8g + 4 + i (rows g, g + 8)
  uint4 v[G::kTiles][2];        // V codes of units 16i + g and 16i + g + 8, tokens 16c..16c+15
  uint4 ks[STATS], kz[STATS];   // K scale, zero of the 8 * STATS channels from the lane's first (see load_k)
  uint4 vs[2], vz[2];           // V scale, zero of tokens 16c..16c+15
};

// K's codes, and K's statistics of 8 * STATS channels from channel `stats0`
template <int BLOCK, int BITS, int STATS>
__device__ __forceinline__ void load_k(PageLoads<BITS, STATS>& in, const uint8_t* page, const Offsets& o, int h,
                                       int lane, int slice0, int stats0) {
  using G = Geometry<BITS>;
  const int g = lane >> 2, c = lane & 3;
  const uint8_t* rows = page + o.k_codes + (size_t(h) * BLOCK + slice0 + 8 * g) * G::kRow + G::kRow / 4 * c;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint8_t* at = rows + (4 * r + i) * G::kRow;
      if constexpr (G::kWords == 4) {
        const uint4 x = load16(at);
        in.k[i][r][0] = x.x, in.k[i][r][1] = x.y, in.k[i][r][2] = x.z, in.k[i][r][3] = x.w;
      } else {
        const uint2 x = __ldg(reinterpret_cast<const uint2*>(at));
        in.k[i][r][0] = x.x, in.k[i][r][1] = x.y;
      }
    }
#pragma unroll
  for (int j = 0; j < STATS; ++j) {
    in.ks[j] = load16(page + o.k_scale + (h * kHead + stats0 + 8 * j) * 2);
    in.kz[j] = load16(page + o.k_zero + (h * kHead + stats0 + 8 * j) * 2);
  }
}

template <int BLOCK, int BITS, int STATS>
__device__ __forceinline__ void load_v(PageLoads<BITS, STATS>& in, const uint8_t* page, const Offsets& o, int h,
                                       int lane, int slice0) {
  using G = Geometry<BITS>;
  const int g = lane >> 2, c = lane & 3;
  // the lane's tokens 16c.. of the slice lie in group tok / kTokenGroup, unit u of it at byte u * kTokenGroup
  const int tok = slice0 + 16 * c;
  const uint8_t* units = page + o.v_codes + ((size_t(h) * (BLOCK / kTokenGroup) + tok / kTokenGroup) * G::kUnits + g) *
                                                kTokenGroup + tok % kTokenGroup;
#pragma unroll
  for (int i = 0; i < G::kTiles; ++i) {
    in.v[i][0] = load16(units + (16 * i) * kTokenGroup);
    in.v[i][1] = load16(units + (16 * i + 8) * kTokenGroup);
  }
  const uint8_t* stats = page + (h * BLOCK + slice0 + 16 * c) * 2;
  in.vs[0] = load16(stats + o.v_scale);
  in.vs[1] = load16(stats + o.v_scale + 16);
  in.vz[0] = load16(stats + o.v_zero);
  in.vz[1] = load16(stats + o.v_zero + 16);
}

// The halves k, k + 2P of a lane's 4P K statistics (X) and k + P, k + 3P (Y), P planes, k = lane % P:
// the query channels its scaled-query registers take
template <int BITS>
__device__ __forceinline__ void stat_pairs(const uint4 (&v)[Geometry<BITS>::kStatVecs], int k, uint32_t& x,
                                           uint32_t& y) {
  const uint32_t sel = (k & 1) ? 0x7632 : 0x5410;  // half k % 2 of two words
  if constexpr (BITS == 4) {
    x = __byte_perm(v[0].x, v[0].z, sel);
    y = __byte_perm(v[0].y, v[0].w, sel);
  } else {
    const bool hi = k >> 1;
    x = __byte_perm(hi ? v[0].y : v[0].x, hi ? v[1].y : v[1].x, sel);
    y = __byte_perm(hi ? v[0].w : v[0].z, hi ? v[1].w : v[1].z, sel);
  }
}

// q.K of the warp's slice: s[i][0..1] for token 8g + i (product row g), s[i][2..3] for token 8g + 4 + i
// (row g + 8), columns 2c, 2c + 1 of the right operand (qa, qb: the scaled query of k-step (w, plane))
template <int BITS, int STATS>
__device__ __forceinline__ void logits(float (&s)[4][4], const PageLoads<BITS, STATS>& in,
                                       const uint32_t (&qa)[Geometry<BITS>::kWords][Geometry<BITS>::kPlanes],
                                       const uint32_t (&qb)[Geometry<BITS>::kWords][Geometry<BITS>::kPlanes]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int r = 0; r < 4; ++r) s[i][r] = 0.f;
#pragma unroll
    for (int w = 0; w < Geometry<BITS>::kWords; ++w) {
      const uint32_t r0 = in.k[i][0][w], r1 = in.k[i][1][w];  // rows g, g + 8
      mma_codes<BITS, 0>(s[i], r0, r1, qa[w][0], qb[w][0]);
      mma_codes<BITS, 1>(s[i], r0, r1, qa[w][1], qb[w][1]);
      if constexpr (Geometry<BITS>::kPlanes == 4) {
        mma_codes<BITS, 2>(s[i], r0, r1, qa[w][2], qb[w][2]);
        mma_codes<BITS, 3>(s[i], r0, r1, qa[w][3], qb[w][3]);
      }
    }
  }
}

// The right operand of p.V from probabilities pr of the lane's 16 tokens (slice positions 16c ..
// 16c + 15): p times V's token scale as float16, k-step s taking tokens 4s + (0, 2) (pa) and 4s + (1,
// 3) (pb); and the lane's sums of p, of p times V's token zero, and of the float16 products. Where
// `tail` (the same for the whole warp), only the tokens t that `valid(t)` holds get statistics (an
// unwritten slot's may be anything). DERIVED: a split-row page's 2-bit half, whose token statistics
// are a 4-bit grid read at 4 c + middle (scale 4 s, zero z + middle s).
template <bool DERIVED = false, int BITS, int STATS, typename Valid>
__device__ __forceinline__ void scaled_probs(float (&pr)[16], const PageLoads<BITS, STATS>& in, bool tail,
                                             Valid valid, uint32_t (&pa)[4], uint32_t (&pb)[4], float& lsum,
                                             float& zsum, float& psum) {
  lsum = zsum = psum = 0.f;
#pragma unroll
  for (int t = 0; t < 16; ++t) {
    float vs = half_at(in.vs, t), vz = half_at(in.vz, t);
    if constexpr (DERIVED) {
      vz = fmaf(kSalientMiddle, vs, vz);
      vs *= 4.f;
    }
    if (tail && !valid(t)) vs = vz = 0.f;
    lsum += pr[t];
    zsum += pr[t] * vz;
    pr[t] *= vs;
  }
#pragma unroll
  for (int st = 0; st < 4; ++st) {
    pa[st] = pack_half2(pr[4 * st], pr[4 * st + 2]);
    pb[st] = pack_half2(pr[4 * st + 1], pr[4 * st + 3]);
    const float2 ra = unpack_half2(pa[st]), rb = unpack_half2(pb[st]);
    psum += (ra.x + ra.y) + (rb.x + rb.y);
  }
}

// acc[plane] += V codes of m-tile (units 16i + g and 16i + g + 8) . p, over the slice's 4 k-steps
template <int BITS>
__device__ __forceinline__ void weighted_values(float (&acc)[Geometry<BITS>::kPlanes][4], const uint4 (&v)[2],
                                                const uint32_t (&pa)[4], const uint32_t (&pb)[4]) {
#pragma unroll
  for (int st = 0; st < 4; ++st) {
    const uint32_t u0 = word(v[0], st), u1 = word(v[1], st);  // rows g, g + 8
    mma_codes<BITS, 0>(acc[0], u0, u1, pa[st], pb[st]);
    mma_codes<BITS, 1>(acc[1], u0, u1, pa[st], pb[st]);
    if constexpr (Geometry<BITS>::kPlanes == 4) {
      mma_codes<BITS, 2>(acc[2], u0, u1, pa[st], pb[st]);
      mma_codes<BITS, 3>(acc[3], u0, u1, pa[st], pb[st]);
    }
  }
}

// MHA: the lane's four channels of the query, scaled by q_scale, in the order the products take its
// share of the query's scaling: channels 4P W + p + {0, 2P, P, 3P}, W = lane / P, plane p = lane % P
// (whose codes enter the products times 2^(p BITS)). `head` points at the head's 128 channels.
template <int BITS, typename T>
__device__ __forceinline__ void lane_query(const T* head, int lane, float q_scale, float (&qf)[4]) {
  constexpr int P = Geometry<BITS>::kPlanes;
  const T* qrow = head + 4 * P * (lane / P) + lane % P;
  const int at[4] = {0, 2 * P, P, 3 * P};
#pragma unroll
  for (int i = 0; i < 4; ++i) qf[i] = to_float(qrow[at[i]]) * q_scale;
}

// MHA: the query scaled by the page's K statistics, gathered into the products' operand order: k-step
// (w, plane k) of lane c takes the channels of bytes (0, 2) and (1, 3) of its word w at plane k (4 bits:
// 32c + 8w + k + (0, 4), (2, 6)); returns the logits' bias, sum q * zero - 1024 * sum(scaled query).
// qf: this lane's four query channels (see decode_mha), p its plane. DERIVED as scaled_probs's, for K.
template <bool DERIVED = false, int BITS, int STATS>
__device__ __forceinline__ float scaled_query(const PageLoads<BITS, STATS>& in, const float (&qf)[4], float plane_div,
                                              int p, int c,
                                              uint32_t (&qa)[Geometry<BITS>::kWords][Geometry<BITS>::kPlanes],
                                              uint32_t (&qb)[Geometry<BITS>::kWords][Geometry<BITS>::kPlanes]) {
  using G = Geometry<BITS>;
  uint32_t sx, sy, zx, zy;
  stat_pairs<BITS>(in.ks, p, sx, sy);
  stat_pairs<BITS>(in.kz, p, zx, zy);
  float2 ksx = unpack_half2(sx), ksy = unpack_half2(sy), kzx = unpack_half2(zx), kzy = unpack_half2(zy);
  if constexpr (DERIVED) {
    kzx = make_float2(fmaf(kSalientMiddle, ksx.x, kzx.x), fmaf(kSalientMiddle, ksx.y, kzx.y));
    kzy = make_float2(fmaf(kSalientMiddle, ksy.x, kzy.x), fmaf(kSalientMiddle, ksy.y, kzy.y));
    ksx = make_float2(4.f * ksx.x, 4.f * ksx.y);
    ksy = make_float2(4.f * ksy.x, 4.f * ksy.y);
  }
  const uint32_t x = pack_half2(qf[0] * plane_div * ksx.x, qf[1] * plane_div * ksx.y);
  const uint32_t y = pack_half2(qf[2] * plane_div * ksy.x, qf[3] * plane_div * ksy.y);
  const float2 xr = unpack_half2(x), yr = unpack_half2(y);
  float bias = qf[0] * kzx.x + qf[1] * kzx.y + qf[2] * kzy.x + qf[3] * kzy.y - 1024.f * ((xr.x + xr.y) + (yr.x + yr.y));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) bias += __shfl_xor_sync(kAll, bias, off);
#pragma unroll
  for (int w = 0; w < G::kWords; ++w)
#pragma unroll
    for (int pl = 0; pl < G::kPlanes; ++pl) {
      const int src = (c * G::kWords + w) * G::kPlanes + pl;
      qa[w][pl] = __shfl_sync(kAll, x, src);
      qb[w][pl] = __shfl_sync(kAll, y, src);
    }
  return bias;
}

// MHA: a slice's final logits s (see logits; -inf where no token) into the warp's running softmax (m,
// lane partials l of p and pz of p times V's zero) and output acc; `tail` and `valid` as scaled_probs's
template <bool DERIVED = false, int BITS, int STATS, typename Valid>
__device__ __forceinline__ void slice_values(float (&s)[4][4], float4* probs, float& m, float& l, float& pz,
                                             float (&acc)[Geometry<BITS>::kTiles][Geometry<BITS>::kPlanes][4],
                                             const PageLoads<BITS, STATS>& in, int g, int c, bool tail, Valid valid) {
  using G = Geometry<BITS>;
  float alpha;
  const float m_ref = slice_max(s, m, alpha);
  float pr[16];  // probabilities of tokens 16c..16c+15
  slice_probabilities(probs, s, m_ref, g, c, pr);
  // p * V's token scale as the right operand: k-step s takes tokens 16c + 4s + (0, 2), (1, 3)
  uint32_t pa[4], pb[4];
  float lsum, zsum, psum;
  scaled_probs<DERIVED>(pr, in, tail, valid, pa, pb, lsum, zsum, psum);
  l = l * alpha + lsum;
  pz = pz * alpha + zsum;
  psum += __shfl_xor_sync(kAll, psum, 1);
  psum += __shfl_xor_sync(kAll, psum, 2);
  const float offset = 1024.f * psum;  // what the codes' 1024 adds to every channel
#pragma unroll
  for (int i = 0; i < G::kTiles; ++i) {
#pragma unroll
    for (int pl = 0; pl < G::kPlanes; ++pl) {
      acc[i][pl][0] = fmaf(acc[i][pl][0], alpha, -offset);
      acc[i][pl][2] = fmaf(acc[i][pl][2], alpha, -offset);
    }
    weighted_values<BITS>(acc[i], in.v[i], pa, pb);
  }
}

template <int BLOCK, int BITS, typename T>
__global__ void __launch_bounds__(kWarps * 32) decode_mha(
    const T* __restrict__ query, const uint8_t* __restrict__ cache, const int32_t* __restrict__ block_table,
    const int32_t* __restrict__ seq_lens, const int32_t* __restrict__ row_order, T* __restrict__ out,
    float* __restrict__ part, float q_scale, int64_t q_stride, int64_t out_stride, int64_t bt_stride,
    int64_t page_bytes, int blocks_per_split, int num_splits, int table_blocks, int num_heads, Offsets o) {
  __shared__ float4 probs[kWarps][kSlice / 4];  // a warp's probabilities, from the logits' lanes to the products'
  __shared__ float other_out[kHead];            // warp 1's output, merged by warp 0
  __shared__ float other_ml[2];
  kvc::allow_next_grid();  // the merge of the splits may be scheduled
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
  kvc::wait_for_prior_grid();  // the cache write before: the query and the pages after this

  using G = Geometry<BITS>;
  constexpr int P = G::kPlanes;
  // This lane's share of the query's scaling (lane_query): plane p = lane % P, whose codes enter the
  // products times 2^(p * BITS), so its query is divided by that
  const int p = lane % P;
  float qf[4];
  lane_query<BITS>(query + row * q_stride + h * kHead, lane, q_scale, qf);
  const float plane_div = 1.f / float(1 << (BITS * p));
  const int stats0 = 4 * P * (lane / P);  // the K statistics this lane reads: those of its query channels

  float m = -INFINITY, l = 0.f, pz = 0.f;  // running max (base 2); lane partials of sum p, sum p * zero
  float acc[G::kTiles][P][4] = {};  // output of plane k, rows g, g + 8 of m-tile i: channels P (16i + g (+ 8)) + k

  PageLoads<BITS> in;
  if (b_first < b_end && holds_slice<BLOCK>(b_first, slice0, L)) {
    const uint8_t* page = page_of(cache, first_entry, page_bytes);
    load_k<BLOCK>(in, page, o, h, lane, slice0, stats0);
    load_v<BLOCK>(in, page, o, h, lane, slice0);
  }
  // a warp stops at the first page that holds none of its slice (on a request's last page, warp 1
  // past a context that ends in the first half), loading nothing for it; stated as a break rather
  // than as the warp's own b_end, with which nvcc gave the 2-bit kernel 81 more registers and spills
  for (int b = b_first; b < b_end; b += S::STEP) {
    if (!holds_slice<BLOCK>(b, slice0, L)) break;
    const uint8_t* next = b + S::STEP < b_end && holds_slice<BLOCK>(b + S::STEP, slice0, L)
                              ? page_of(cache, table[b + S::STEP], page_bytes)
                              : nullptr;

    uint32_t qa[G::kWords][P], qb[G::kWords][P];
    const float bias = scaled_query(in, qf, plane_div, p, c, qa, qb);

    // logits: s[i][0] of token 8g + i, s[i][2] of token 8g + 4 + i
    float s[4][4];
    logits<BITS>(s, in, qa, qb);
    if (next != nullptr) load_k<BLOCK>(in, next, o, h, lane, slice0, stats0);  // K's registers are free

    // softmax over the slice: tokens at or past L (on the last page) get no weight
    const int pos = b * BLOCK + slice0;  // position of the slice's token 0
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int r = 0; r < 4; r += 2) {
        s[i][r] += bias;
        if (pos + 8 * g + 2 * r + i >= L) s[i][r] = -INFINITY;
      }
    slice_values(s, probs[warp], m, l, pz, acc, in, g, c, pos + kSlice > L,
                 [&](int t) { return pos + 16 * c + t < L; });
    if (next != nullptr) load_v<BLOCK>(in, next, o, h, lane, slice0);
  }

  // lane partials -> the warp's (lanes of one g hold its 64 tokens); then the warps merged
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l += __shfl_xor_sync(kAll, l, off);
    pz += __shfl_xor_sync(kAll, pz, off);
  }
  // lane (g, 0) holds channels P * (16i + g) + k and P * (16i + g + 8) + k of plane k, whose codes
  // came times 2^(k * BITS)
  if (warp == 1 && c == 0) {
#pragma unroll
    for (int i = 0; i < G::kTiles; ++i)
#pragma unroll
      for (int pl = 0; pl < P; ++pl)
#pragma unroll
        for (int r = 0; r < 4; r += 2)
          other_out[P * (16 * i + g + 4 * r) + pl] = acc[i][pl][r] * (1.f / float(1 << (BITS * pl))) + pz;
    if (g == 0) {
      other_ml[0] = m;
      other_ml[1] = l;
    }
  }
  __syncthreads();
  if (warp != 0 || c != 0) return;
  const auto [mm, w0, w1, lt] = merge_partials(m, l, other_ml[0], other_ml[1]);
  const float scale = num_splits == 1 ? 1.f / lt : 1.f;
  float* partial = part + ((int64_t(row) * num_heads + h) * num_splits + split) * (kHead + 2);
  T* dst = out + row * out_stride + h * kHead;
#pragma unroll
  for (int i = 0; i < G::kTiles; ++i)
#pragma unroll
    for (int pl = 0; pl < P; ++pl)
#pragma unroll
      for (int r = 0; r < 4; r += 2) {
        const int ch = P * (16 * i + g + 4 * r) + pl;
        const float v = ((acc[i][pl][r] * (1.f / float(1 << (BITS * pl))) + pz) * w0 + other_out[ch] * w1) * scale;
        if (num_splits == 1)
          dst[ch] = from_float(v, static_cast<T*>(nullptr));
        else
          partial[ch] = v;  // unnormalized output of this split
      }
  if (num_splits > 1 && g == 0) {
    partial[kHead] = mm;
    partial[kHead + 1] = lt;
  }
}

// Grouped-query attention: the G query heads of a KV head (G = 2 or 4, a multiple of the planes) are
// the right operand's columns (column n: head n % G), so a page is read once for all of them. Each column has its own
// running maximum and sum; a lane's logits and outputs are those of columns 2c and 2c + 1, its
// probabilities (the right operand of p.V) those of column g. Everything else as decode_mha.
template <int BLOCK, int BITS, int GROUP, typename T>
__global__ void __launch_bounds__(kWarps * 32) decode_gqa(
    const T* __restrict__ query, const uint8_t* __restrict__ cache, const int32_t* __restrict__ block_table,
    const int32_t* __restrict__ seq_lens, const int32_t* __restrict__ row_order, T* __restrict__ out,
    float* __restrict__ part, float q_scale, int64_t q_stride, int64_t out_stride, int64_t bt_stride,
    int64_t page_bytes, int blocks_per_split, int num_splits, int table_blocks, int num_heads, Offsets o) {
  using G = Geometry<BITS>;
  constexpr int P = G::kPlanes;
  constexpr int LANES = 32 / GROUP;  // lanes that scale one head's query
  constexpr int STATS = GROUP / 2;   // 16-byte vectors of the 4 * GROUP channels a lane scales
  __shared__ float4 probs[kWarps][GROUP][kSlice / 4];  // [warp][head][token]
  __shared__ float other_out[GROUP][kHead];
  __shared__ float other_ml[GROUP][2];
  // (decode_mha's set-up: these values as one struct from a shared function compiled to 7 more
  // registers in decode_mha, so each kernel computes them itself)
  kvc::allow_next_grid();  // the merge of the splits may be scheduled
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
  kvc::wait_for_prior_grid();  // the cache write before: the query and the pages after this

  // This lane scales the query of head `qh` (of the group) over channels stats0 .. stats0 + 4 GROUP - 1:
  // operand pairs j = GROUP * (lane % LANES) + t, t < GROUP, pair j being word j / P at plane j % P
  const int qh = lane / LANES;
  const int stats0 = 4 * GROUP * (lane % LANES);
  float qf[4 * GROUP];  // channel stats0 + x, times the softmax scale
  {
    const T* qrow = query + row * q_stride + (h * GROUP + qh) * kHead + stats0;
#pragma unroll
    for (int x = 0; x < 4 * GROUP; ++x) qf[x] = to_float(qrow[x]) * q_scale;
  }

  float m[2] = {-INFINITY, -INFINITY};  // running max (base 2) of columns 2c, 2c + 1
  float l = 0.f, pz = 0.f;              // lane partials of sum p, sum p * zero of column g
  // plane k, m-tile i: rows g, g + 8 (channels P (16i + g (+ 8)) + k) x columns 2c, 2c + 1
  float acc[G::kTiles][P][4] = {};

  PageLoads<BITS, STATS> in;
  if (b_first < b_end && holds_slice<BLOCK>(b_first, slice0, L)) {
    const uint8_t* page = page_of(cache, first_entry, page_bytes);
    load_k<BLOCK>(in, page, o, h, lane, slice0, stats0);
    load_v<BLOCK>(in, page, o, h, lane, slice0);
  }
  for (int b = b_first; b < b_end; b += S::STEP) {
    if (!holds_slice<BLOCK>(b, slice0, L)) break;  // as decode_mha
    const uint8_t* next = b + S::STEP < b_end && holds_slice<BLOCK>(b + S::STEP, slice0, L)
                              ? page_of(cache, table[b + S::STEP], page_bytes)
                              : nullptr;

    // scaled query: this lane's pairs, then each lane gathers column g's operand (as decode_mha)
    uint32_t qa[G::kWords][P], qb[G::kWords][P];
    float bias[2];  // of columns 2c, 2c + 1
    {
      uint32_t x[GROUP], y[GROUP];
      float part_bias = 0.f;
#pragma unroll
      for (int t = 0; t < GROUP; ++t) {
        const int k = t % P, base = 4 * P * (t / P) + k;  // channels base + (0, 2P) -> x, base + (P, 3P) -> y
        const int at[4] = {base, base + 2 * P, base + P, base + 3 * P};
        float qs[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ch = at[e];
          qs[e] = qf[ch] * (1.f / float(1 << (BITS * k))) * half_at<STATS>(in.ks, ch);
          part_bias += qf[ch] * half_at<STATS>(in.kz, ch);
        }
        x[t] = pack_half2(qs[0], qs[1]);
        y[t] = pack_half2(qs[2], qs[3]);
        const float2 xr = unpack_half2(x[t]), yr = unpack_half2(y[t]);
        part_bias -= 1024.f * ((xr.x + xr.y) + (yr.x + yr.y));
      }
#pragma unroll
      for (int off = 1; off < LANES; off <<= 1) part_bias += __shfl_xor_sync(kAll, part_bias, off);
#pragma unroll
      for (int e = 0; e < 2; ++e) bias[e] = __shfl_sync(kAll, part_bias, ((2 * c + e) % GROUP) * LANES);
#pragma unroll
      for (int w = 0; w < G::kWords; ++w)
#pragma unroll
        for (int pl = 0; pl < P; ++pl) {
          const int j = (c * G::kWords + w) * P + pl;  // pair of head g % GROUP
          const int src = (g % GROUP) * LANES + j / GROUP;
          qa[w][pl] = __shfl_sync(kAll, x[(w * P + pl) % GROUP], src);
          qb[w][pl] = __shfl_sync(kAll, y[(w * P + pl) % GROUP], src);
        }
    }

    // logits: s[i][e] of token 8g + i, s[i][2 + e] of token 8g + 4 + i, column 2c + e
    float s[4][4];
    logits<BITS>(s, in, qa, qb);
    if (next != nullptr) load_k<BLOCK>(in, next, o, h, lane, slice0, stats0);

    const int pos = b * BLOCK + slice0;
    float alpha[2], m_ref[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int r = 0; r < 4; r += 2) {
          s[i][r + e] += bias[e];
          if (pos + 8 * g + 2 * r + i >= L) s[i][r + e] = -INFINITY;
          mx = fmaxf(mx, s[i][r + e]);
        }
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(kAll, mx, off));
      const float m_new = fmaxf(m[e], mx);
      m_ref[e] = m_new == -INFINITY ? 0.f : m_new;
      alpha[e] = ex2(m[e] - m_ref[e]);
      m[e] = m_new;
      if (2 * c + e < GROUP) {  // columns past the group repeat its heads
        float4* dst = probs[warp][2 * c + e] + 2 * g;
        dst[0] = make_float4(ex2(s[0][e] - m_ref[e]), ex2(s[1][e] - m_ref[e]), ex2(s[2][e] - m_ref[e]),
                             ex2(s[3][e] - m_ref[e]));
        dst[1] = make_float4(ex2(s[0][2 + e] - m_ref[e]), ex2(s[1][2 + e] - m_ref[e]), ex2(s[2][2 + e] - m_ref[e]),
                             ex2(s[3][2 + e] - m_ref[e]));
      }
    }
    __syncwarp();
    float pr[16];  // column g's probabilities of tokens 16c..16c+15
#pragma unroll
    for (int q4 = 0; q4 < 4; ++q4) {
      const float4 v4 = probs[warp][g % GROUP][4 * c + q4];
      pr[4 * q4] = v4.x;
      pr[4 * q4 + 1] = v4.y;
      pr[4 * q4 + 2] = v4.z;
      pr[4 * q4 + 3] = v4.w;
    }
    __syncwarp();

    uint32_t pa[4], pb[4];
    float lsum, zsum, psum;
    scaled_probs(pr, in, pos + kSlice > L, [&](int t) { return pos + 16 * c + t < L; }, pa, pb, lsum, zsum, psum);
    // column g's rescale: its maximum is held by the lanes of columns (2c', 2c' + 1) = g
    const float a0 = __shfl_sync(kAll, alpha[0], g >> 1), a1 = __shfl_sync(kAll, alpha[1], g >> 1);
    const float alpha_g = (g & 1) ? a1 : a0;
    l = l * alpha_g + lsum;
    pz = pz * alpha_g + zsum;
    psum += __shfl_xor_sync(kAll, psum, 1);
    psum += __shfl_xor_sync(kAll, psum, 2);
    float offset[2];  // of columns 2c, 2c + 1, from the lanes whose g is that column
#pragma unroll
    for (int e = 0; e < 2; ++e) offset[e] = 1024.f * __shfl_sync(kAll, psum, 4 * (2 * c + e));

#pragma unroll
    for (int i = 0; i < G::kTiles; ++i) {
#pragma unroll
      for (int pl = 0; pl < P; ++pl)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[i][pl][r] = fmaf(acc[i][pl][r], alpha[r & 1], -offset[r & 1]);
      weighted_values<BITS>(acc[i], in.v[i], pa, pb);
    }
    if (next != nullptr) load_v<BLOCK>(in, next, o, h, lane, slice0);
  }

  // column g's sums over the warp, then each lane takes those of its columns 2c, 2c + 1
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l += __shfl_xor_sync(kAll, l, off);
    pz += __shfl_xor_sync(kAll, pz, off);
  }
  float lc[2], pzc[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    lc[e] = __shfl_sync(kAll, l, 4 * (2 * c + e));
    pzc[e] = __shfl_sync(kAll, pz, 4 * (2 * c + e));
  }
  if (warp == 1) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (2 * c + e >= GROUP) continue;
#pragma unroll
      for (int i = 0; i < G::kTiles; ++i)
#pragma unroll
        for (int pl = 0; pl < P; ++pl)
#pragma unroll
          for (int r = 0; r < 4; r += 2)
            other_out[2 * c + e][P * (16 * i + g + 4 * r) + pl] =
                acc[i][pl][r + e] * (1.f / float(1 << (BITS * pl))) + pzc[e];
      if (g == 0) {
        other_ml[2 * c + e][0] = m[e];
        other_ml[2 * c + e][1] = lc[e];
      }
    }
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int col = 2 * c + e;
    if (col >= GROUP) continue;
    const auto [mm, w0, w1, lt] = merge_partials(m[e], lc[e], other_ml[col][0], other_ml[col][1]);
    const float scale = num_splits == 1 ? 1.f / lt : 1.f;
    const int qhead = h * GROUP + col;
    float* partial = part + ((int64_t(row) * num_heads * GROUP + qhead) * num_splits + split) * (kHead + 2);
    T* dst = out + row * out_stride + qhead * kHead;
#pragma unroll
    for (int i = 0; i < G::kTiles; ++i)
#pragma unroll
      for (int pl = 0; pl < P; ++pl)
#pragma unroll
        for (int r = 0; r < 4; r += 2) {
          const int ch = P * (16 * i + g + 4 * r) + pl;
          const float v =
              ((acc[i][pl][r + e] * (1.f / float(1 << (BITS * pl))) + pzc[e]) * w0 + other_out[col][ch] * w1) * scale;
          if (num_splits == 1)
            dst[ch] = from_float(v, static_cast<T*>(nullptr));
          else
            partial[ch] = v;
        }
    if (num_splits > 1 && g == 0) {
      partial[kHead] = mm;
      partial[kHead + 1] = lt;
    }
  }
}

}  // namespace

// ZipCache's split-row pages (formats/salient_rows.py), MHA, pages of 128 tokens: a page is a 4-bit
// half (rows 0..63, laid out as a 4/4 page's slice) and a 2-bit half (rows 64..127, as a 2/2 page's)
// on one grid, which the 2-bit half reads as 4 c + middle: K's scale 4 s and zero z + middle s per
// channel, V's per row. Warp 0 reads every page's 4-bit half, warp 1 its 2-bit half, each as
// decode_mha reads a slice, in softmaxes of their own merged at the end; on a row's last page the rows
// that hold no token of its history (place_of EMPTY, or past it) get no weight. Split 0 attends the
// row's own new token (the decode write stores it after attention), and the kernel leaves the
// natural log-sum-exp the write scores with: salient_decode_kernel.cu's contract for slot-map pages.
constexpr int kRowsPage = kWarps * kSlice;  // tokens a split-row page: a slice of 64 rows each half

struct RowsOffsets {
  Offsets half[2];  // the 4-bit half's regions, then the 2-bit half's (K's statistics: the shared grid)
  int place_of;     // [H, 128] uint8: a row's place in its page
};

// Byte t (0..3) of w, a row's place
__device__ __forceinline__ int place_byte(uint32_t w, int t) { return (w >> (8 * t)) & 0xFF; }

// One warp's half of every page of its split: running maximum m, sums l (p) and pz (p times V's
// zero), lane partials, and the output acc, as decode_mha's loop leaves them
template <int BITS, typename T>
__device__ __forceinline__ void rows_half(float (&acc)[Geometry<BITS>::kTiles][Geometry<BITS>::kPlanes][4], float& m,
                                          float& l, float& pz, float4* probs, const T* qrow_base, float q_scale,
                                          const uint8_t* cache, const int32_t* table, int first_entry, int b_start,
                                          int b_end, int L, int h, int lane, int64_t page_bytes, const Offsets& o,
                                          int place_of) {
  using G = Geometry<BITS>;
  constexpr int P = G::kPlanes;
  constexpr int kFirstRow = BITS == 4 ? 0 : kSlice;  // the half's first row, in place_of
  const int g = lane >> 2, c = lane & 3;
  const int p = lane % P;
  float qf[4];
  lane_query<BITS>(qrow_base, lane, q_scale, qf);
  const float plane_div = 1.f / float(1 << (BITS * p));
  const int stats0 = 4 * P * (lane / P);

  PageLoads<BITS> in;
  const uint8_t* page = nullptr;
  if (b_start < b_end) {
    page = page_of(cache, first_entry, page_bytes);
    load_k<kSlice>(in, page, o, h, lane, 0, stats0);
    load_v<kSlice>(in, page, o, h, lane, 0);
  }
  for (int b = b_start; b < b_end; ++b) {
    const uint8_t* next = b + 1 < b_end ? page_of(cache, table[b + 1], page_bytes) : nullptr;
    const int count = L - b * kRowsPage;  // history tokens of the page: all of it but on the last page
    const bool tail = count < kRowsPage;  // the same for the whole warp
    uint2 k_place = make_uint2(0, 0);     // places of the lane's K rows 8g..8g+7 and V rows 16c..16c+15
    uint4 v_place = make_uint4(0, 0, 0, 0);
    if (tail) {
      const uint8_t* places = page + place_of + h * kRowsPage + kFirstRow;
      k_place = __ldg(reinterpret_cast<const uint2*>(places + 8 * g));
      v_place = load16(places + 16 * c);
    }

    constexpr bool kDerived = BITS == 2;  // the 2-bit half reads the shared grid at 4 c + middle
    uint32_t qa[G::kWords][P], qb[G::kWords][P];
    const float bias = scaled_query<kDerived>(in, qf, plane_div, p, c, qa, qb);
    float s[4][4];
    logits<BITS>(s, in, qa, qb);
    if (next != nullptr) load_k<kSlice>(in, next, o, h, lane, 0, stats0);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int r = 0; r < 4; r += 2) {  // row 8g + 2r + i
        s[i][r] += bias;
        if (tail && !(place_byte(r ? k_place.y : k_place.x, i) < count)) s[i][r] = -INFINITY;
      }
    slice_values<kDerived>(s, probs, m, l, pz, acc, in, g, c, tail,
                           [&](int t) { return place_byte(word(v_place, t >> 2), t & 3) < count; });
    if (next != nullptr) load_v<kSlice>(in, next, o, h, lane, 0);
    page = next;
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l += __shfl_xor_sync(kAll, l, off);
    pz += __shfl_xor_sync(kAll, pz, off);
  }
}

// Output channel of plane pl, accumulator register r (0: row g, 2: row g + 8) of m-tile i
template <int BITS>
__device__ __forceinline__ int rows_channel(int g, int i, int pl, int r) {
  return Geometry<BITS>::kPlanes * (16 * i + g + 4 * r) + pl;
}

__device__ __forceinline__ void both_warps_here() { asm volatile("bar.sync 1, %0;" ::"n"(kWarps * 32) : "memory"); }

template <typename T>
__global__ void __launch_bounds__(kWarps * 32) salient_rows_decode(
    const T* __restrict__ query, const uint8_t* __restrict__ cache, const int32_t* __restrict__ block_table,
    const int32_t* __restrict__ seq_lens, const int32_t* __restrict__ row_order, const T* __restrict__ key,
    const T* __restrict__ value, T* __restrict__ out, float* __restrict__ part, float* __restrict__ lse,
    float q_scale, int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t out_stride, int64_t bt_stride,
    int64_t page_bytes, int64_t lse_stride, int blocks_per_split, int num_splits, int table_blocks, int num_heads,
    RowsOffsets o) {
  __shared__ float4 probs[kWarps][kSlice / 4];
  __shared__ float other_out[kHead];  // warp 1's output, merged by warp 0
  __shared__ float other_ml[2];
  kvc::allow_next_grid();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int h = blockIdx.x % num_heads;
  const int row = row_order != nullptr ? row_order[blockIdx.x / num_heads] : blockIdx.x / num_heads;
  const int split = blockIdx.y;
  const int b_start = split * blocks_per_split;
  const int32_t* table = block_table + row * bt_stride;
  const int first_entry = first_table_entry(table, b_start, table_blocks);
  const int L = seq_lens[row];  // the row's history
  const int b_end = min(b_start + blocks_per_split, (L + kRowsPage - 1) / kRowsPage);
  kvc::wait_for_prior_grid();  // the kernels before: the query and new K, V after this
  const T* qrow = query + row * q_stride + h * kHead;
  float m = -INFINITY, l = 0.f, pz = 0.f;

  if (warp == 1) {
    float acc[Geometry<2>::kTiles][Geometry<2>::kPlanes][4] = {};
    rows_half<2, T>(acc, m, l, pz, probs[1], qrow, q_scale, cache, table, first_entry, b_start, b_end, L, h, lane,
                    page_bytes, o.half[1], o.place_of);
    if (c == 0) {
#pragma unroll
      for (int i = 0; i < Geometry<2>::kTiles; ++i)
#pragma unroll
        for (int pl = 0; pl < Geometry<2>::kPlanes; ++pl)
#pragma unroll
          for (int r = 0; r < 4; r += 2)
            other_out[rows_channel<2>(g, i, pl, r)] = acc[i][pl][r] * (1.f / float(1 << (2 * pl))) + pz;
      if (g == 0) {
        other_ml[0] = m;
        other_ml[1] = l;
      }
    }
    both_warps_here();
    return;
  }

  // warp 0: the new token's logit (base 2) from the lane's query channels (rows_half's for 4 bits)
  float own = 0.f;
  if (split == 0) {  // the lane's query channels (lane_query's) times the same channels of the new K
    float qf[4], kf[4];
    lane_query<4>(qrow, lane, q_scale, qf);
    lane_query<4>(key + row * k_stride + h * kHead, lane, 1.f, kf);
#pragma unroll
    for (int i = 0; i < 4; ++i) own += qf[i] * kf[i];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) own += __shfl_xor_sync(kAll, own, off);
  }
  float acc[Geometry<4>::kTiles][Geometry<4>::kPlanes][4] = {};
  rows_half<4, T>(acc, m, l, pz, probs[0], qrow, q_scale, cache, table, first_entry, b_start, b_end, L, h, lane,
                  page_bytes, o.half[0], o.place_of);
  both_warps_here();
  if (c != 0) return;
  const OwnTokenOutput<T> result(m, l, other_ml[0], other_ml[1], own, split, num_splits,
                                 value + row * v_stride + h * kHead, out + row * out_stride + h * kHead,
                                 part + ((int64_t(row) * num_heads + h) * num_splits + split) * (kHead + 2));
#pragma unroll
  for (int i = 0; i < Geometry<4>::kTiles; ++i)
#pragma unroll
    for (int pl = 0; pl < Geometry<4>::kPlanes; ++pl)
#pragma unroll
      for (int r = 0; r < 4; r += 2) {
        const int ch = rows_channel<4>(g, i, pl, r);
        result.put(ch, acc[i][pl][r] * (1.f / float(1 << (4 * pl))) + pz, other_out[ch]);
      }
  if (g == 0) result.finish(lse + h * lse_stride + row);
}

template <int BLOCK, int BITS, int GROUP, typename T>
constexpr auto decode_kernel() {
  if constexpr (GROUP == 1)
    return decode_mha<BLOCK, BITS, T>;
  else
    return decode_gqa<BLOCK, BITS, GROUP, T>;
}

// A decode's arguments, one struct so that the caller (ctypes) converts one pointer a call rather
// than 28 values; cuda_decode.py's _DecodeArgs mirrors it field for field.
struct DecodeArgs {
  const void* query;        // [num_rows, query heads, 128] rows q_stride elements apart
  const void* cache;        // [num_blocks, page_bytes] uint8
  const void* block_table;  // [num_rows, ...] int32, rows bt_stride apart
  const void* seq_lens;     // [num_rows] int32
  const void* row_order;    // [num_rows] int32 or null: the order in which rows take blocks
  void* out;                // rows out_stride elements apart
  void* part;               // [num_rows, query heads, num_splits, 130] float32 where num_splits > 1
  float q_scale;
  int64_t q_stride, out_stride, bt_stride, page_bytes;
  int blocks_per_split, num_splits;
  int table_blocks;  // the block-table entries a row may be read at (the pages of max_seq_len)
  int num_rows, num_heads;
  int k_codes, k_scale, k_zero, v_codes, v_scale, v_zero;  // byte offsets of a page's regions
  int block_size, bits, group;  // pages of 64 or 128 tokens, 2 or 4 bits, 1, 2 or 4 query heads a KV head
  int bf16;                     // queries in bfloat16 (else float16)
  void* stream;                 // a cudaStream_t
};

// Decode and merge launched to start before the kernel before them ends (dependent_launch.cuh)
template <int BLOCK, int BITS, int GROUP, typename T>
static cudaError_t launch(const DecodeArgs& a) {
  const Offsets o{a.k_codes, a.k_scale, a.k_zero, a.v_codes, a.v_scale, a.v_zero};
  const dim3 grid(a.num_rows * a.num_heads, a.num_splits);
  const auto stream = static_cast<cudaStream_t>(a.stream);
  cudaError_t err = kvc::launch_dependent(
      decode_kernel<BLOCK, BITS, GROUP, T>(), grid, dim3(kWarps * 32), stream, static_cast<const T*>(a.query),
      static_cast<const uint8_t*>(a.cache), static_cast<const int32_t*>(a.block_table),
      static_cast<const int32_t*>(a.seq_lens), static_cast<const int32_t*>(a.row_order), static_cast<T*>(a.out),
      static_cast<float*>(a.part), a.q_scale, a.q_stride, a.out_stride, a.bt_stride, a.page_bytes,
      a.blocks_per_split, a.num_splits, a.table_blocks, a.num_heads, o);
  if (err == cudaSuccess && a.num_splits > 1)
    err = kvc::launch_dependent(merge_splits<T>, dim3(a.num_rows, a.num_heads * GROUP), dim3(kHead), stream,
                                static_cast<const float*>(a.part), static_cast<T*>(a.out), a.out_stride,
                                a.num_splits, static_cast<float*>(nullptr), int64_t(0));
  return err;
}

using Launcher = cudaError_t (*)(const DecodeArgs&);

// A group's query scaling deals whole words to a lane, so the group is a multiple of the planes
// (2-bit codes: 4 query heads a KV head, or one). Groups of 8 compile (255 registers) but were no
// faster than the Triton kernel (docs/benchmarks.md), so they are not launched.
template <int BLOCK, int BITS, typename T>
static Launcher launcher(int group) {
  constexpr int P = Geometry<BITS>::kPlanes;
  if (group == 1) return launch<BLOCK, BITS, 1, T>;
  if constexpr (2 % P == 0) {
    if (group == 2) return launch<BLOCK, BITS, 2, T>;
  }
  return group == 4 ? launch<BLOCK, BITS, 4, T> : nullptr;
}

template <int BLOCK>
static Launcher launcher(int bits, int group, int bf16) {
  return bits == 4 ? (bf16 ? launcher<BLOCK, 4, __nv_bfloat16>(group) : launcher<BLOCK, 4, __half>(group))
         : bits == 2 ? (bf16 ? launcher<BLOCK, 2, __nv_bfloat16>(group) : launcher<BLOCK, 2, __half>(group))
                     : nullptr;
}

// Launches on `stream` the decode and, where num_splits > 1, the merge of the splits' partials into
// `out`, so one call does the whole decode. Returns the launch's cudaError_t (cudaErrorInvalidValue
// for other page sizes, widths or groups).
extern "C" int kvc_decode(const DecodeArgs* a) {
  const Launcher f = a->block_size == 128  ? launcher<128>(a->bits, a->group, a->bf16)
                     : a->block_size == 64 ? launcher<64>(a->bits, a->group, a->bf16)
                                           : nullptr;
  return static_cast<int>(f == nullptr ? cudaErrorInvalidValue : f(*a));
}

// A split-row decode's arguments (cuda_salient_rows_decode.py's _SalientRowsDecodeArgs, field for field)
struct SalientRowsDecodeArgs {
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
  int blocks_per_split, num_splits, table_blocks, num_rows, num_heads;
  int k_scale, k_zero, k4, v4, v4_scale, v4_zero, k2, v2, v2_scale, v2_zero, place_of;  // byte offsets in a page
  int block_size;  // 128
  int bf16;        // queries in bfloat16 (else float16)
  void* stream;    // a cudaStream_t
};

template <typename T>
static cudaError_t launch_rows(const SalientRowsDecodeArgs& a) {
  const RowsOffsets o{{Offsets{a.k4, a.k_scale, a.k_zero, a.v4, a.v4_scale, a.v4_zero},
                       Offsets{a.k2, a.k_scale, a.k_zero, a.v2, a.v2_scale, a.v2_zero}},
                      a.place_of};
  return launch_own_token_decode<T>(salient_rows_decode<T>, a, o);
}

// ZipCache's decode rows over split-row pages (salient_rows_decode, and the merge of its splits).
// Returns a cudaError_t (cudaErrorInvalidValue for pages of other than 128 tokens).
extern "C" int kvc_salient_rows_decode(const SalientRowsDecodeArgs* a) {
  if (a->block_size != kRowsPage) return static_cast<int>(cudaErrorInvalidValue);
  return static_cast<int>(a->bf16 ? launch_rows<__nv_bfloat16>(*a) : launch_rows<__half>(*a));
}
