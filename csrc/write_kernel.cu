// The cache write for quantized pages (2, 4 or 8 bits; K or V, statistics per channel or per
// token): quantize, pack and scatter new tokens into their pages in one pass. Same contract and
// same bytes as paged_torch.write_tokens, which is the reference (see docs/formats.md for the
// append rule).
//
// One warp per (new token, KV head, tensor); lane l holds channels l * CPL .. l * CPL + CPL - 1 of
// the row (CPL = head size / 32), so a row's statistics are a warp reduction and its codes one
// store per lane, with no block-wide barrier. Where statistics are per channel, the block's work
// goes to the warps of its last new tokens:
// - one token appended to stored ones (decoding): the token is coded on its channels' stored grids;
//   a channel it falls off widens (with a margin past the value), and only the storage units
//   holding a widened channel are re-encoded in the earlier rows, those (row, unit) pairs dealt
//   out over the warp's lanes; at 2 and 4 bits a widened channel's earlier codes are mapped
//   through a table of new code by old code, built first with the reference's arithmetic (the
//   same bytes, with a divide an old code rather than one a row);
// - the first token of a block (decoding into a new page): a lane takes 4 channels, each on its
//   value's own grid;
// - several new tokens (a prompt's block, or a chunk appended to stored rows): the block's chunks
//   of 4 channels are dealt out over the warps of its last 32 new tokens, a lane a row, with two
//   passes over the rows, one for the statistics and one for the codes.
//
// Rounding follows the reference step by step: every multiply, add and divide is an explicitly
// rounded intrinsic, so the compiler cannot fuse a multiply and an add into one FMA.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "dependent_launch.cuh"
#include "min_max_grid.cuh"

namespace {

using namespace kvc;
constexpr unsigned kAll = 0xffffffffu;
constexpr int kWarps = 4;      // warps a thread block (each on its own work item)
constexpr int kAppendUnroll = 8;  // (row, unit) pairs a lane has in flight at once

struct Tensor {
  const void* src;   // [N, H, D] rows src_stride elements apart
  int64_t src_stride;
  int codes, row_bytes, scale, zero;  // byte offsets in a page, bytes of one (token, head) row
  // statistics per token: tokens whose codes of one unit lie together (TensorLayout.token_group);
  // 0: statistics per channel, rows head-major
  int token_group;
};

// How a warp holds one row of D channels at BITS bits. A lane's codes fill LANE_BITS; where that is
// under a byte (head size 64 at 2 bits), G lanes share one storage unit. A unit is UNIT_BYTES bytes,
// channel k of the unit in bits k * BITS (8 / BITS channels a byte, the first in the lowest bits).
template <int BITS, int D>
struct Lanes {
  static_assert(D % 32 == 0 && D <= 256, "head size a multiple of 32, at most 256");
  static constexpr int CPL = D / 32;
  static constexpr int LANE_BITS = CPL * BITS;
  static constexpr int G = LANE_BITS >= 8 ? 1 : 8 / LANE_BITS;
  static constexpr int UNIT_BYTES = LANE_BITS >= 8 ? LANE_BITS / 8 : 1;
  static constexpr int UNIT_CHANNELS = CPL * G;
  static constexpr unsigned MASK = (1u << BITS) - 1;
  static constexpr float TOP = float((1 << BITS) - 1);
  using Word = std::conditional_t<(UNIT_BYTES == 8), unsigned long long, unsigned>;

  // bit offset, in the lane's unit, of the lane's channel k
  __device__ static int shift(int lane, int k) { return ((lane % G) * CPL + k) * BITS; }

  __device__ static Word load(const uint8_t* p) {
    if constexpr (UNIT_BYTES == 1) return *p;
    else if constexpr (UNIT_BYTES == 2) return *reinterpret_cast<const uint16_t*>(p);
    else if constexpr (UNIT_BYTES == 4) return *reinterpret_cast<const uint32_t*>(p);
    else return *reinterpret_cast<const unsigned long long*>(p);
  }

  __device__ static void store(uint8_t* p, Word w) {
    if constexpr (UNIT_BYTES == 1) *p = uint8_t(w);
    else if constexpr (UNIT_BYTES == 2) *reinterpret_cast<uint16_t*>(p) = uint16_t(w);
    else if constexpr (UNIT_BYTES == 4) *reinterpret_cast<uint32_t*>(p) = uint32_t(w);
    else *reinterpret_cast<unsigned long long*>(p) = w;
  }

  // the unit of a row whose lanes' parts are w (each lane's codes at its shift): OR over the G lanes
  __device__ static Word gather(Word w) {
    for (int o = 1; o < G; o <<= 1) w |= __shfl_xor_sync(kAll, w, o);
    return w;
  }
};

template <typename T, int D>
__device__ __forceinline__ void load_row(const T* row, int lane, float (&x)[D / 32]) {
#pragma unroll
  for (int k = 0; k < D / 32; ++k) x[k] = to_float(row[lane * (D / 32) + k]);
}

// Statistics per token: the token's own row. Its codes are stored in groups of G = t.token_group
// tokens, unit-major within a group, [H, BLOCK / G, row bytes, G], so a byte of G consecutive tokens
// lies together and the token's bytes within G x row bytes.
template <typename T, int BITS, int D>
__device__ void write_row_per_token(const Tensor& t, int64_t i, uint8_t* page, int h, int off, int BLOCK,
                                    int lane) {
  using L = Lanes<BITS, D>;
  float x[L::CPL];
  load_row<T, D>(static_cast<const T*>(t.src) + i * t.src_stride + h * D, lane, x);
  float lo = x[0], hi = x[0];
#pragma unroll
  for (int k = 1; k < L::CPL; ++k) lo = fminf(lo, x[k]), hi = fmaxf(hi, x[k]);
  for (int o = 16; o > 0; o >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(kAll, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(kAll, hi, o));
  }
  const float2 stats = min_max_stats(lo, hi, L::TOP);  // (zero, scale)
  typename L::Word w = 0;
#pragma unroll
  for (int k = 0; k < L::CPL; ++k)
    w |= typename L::Word(clamped_code(x[k], stats.x, stats.y, L::TOP)) << L::shift(lane, k);
  w = L::gather(w);
  if (lane % L::G == 0) {
    const int group = t.token_group;
    uint8_t* unit = page + t.codes +
                    ((int64_t(h) * (BLOCK / group) + off / group) * t.row_bytes + (lane / L::G) * L::UNIT_BYTES) * group +
                    off % group;
#pragma unroll
    for (int b = 0; b < L::UNIT_BYTES; ++b) unit[b * group] = uint8_t(w >> (8 * b));
  }
  if (lane == 0) {
    store_half(page + t.scale + (h * BLOCK + off) * 2, stats.y);
    store_half(page + t.zero + (h * BLOCK + off) * 2, stats.x);
  }
}

// A table word whose channels all keep their grids: each old code maps to itself.
template <typename Word, int BITS>
constexpr Word identity_tables() {
  Word w = 0;
  for (int bit = 0; bit < int(8 * sizeof(Word)); bit += BITS) w |= Word(bit % (BITS << BITS) / BITS) << bit;
  return w;
}

// How the earlier codes of the storage units that hold a widened channel are requantized. At 2 and
// 4 bits through each channel's table of new code by old code: channel u's table lies in bits
// u * TABLE_BITS of its unit's WORDS words, old code q's new code in bits q * BITS of it; word w of
// the pos-th such unit is at tables[w][pos], so that lanes on consecutive units read consecutive
// words. The tables start as the identity, then the widened channels' are built, one a job.
template <int BITS, int D, bool = (BITS <= 4)>
struct Requantize {
  using L = Lanes<BITS, D>;
  static constexpr int TABLE_BITS = BITS << BITS;
  static_assert(TABLE_BITS == 8 || TABLE_BITS == 64, "a table is a byte or a whole word");
  using Word = std::conditional_t<(L::UNIT_CHANNELS * TABLE_BITS <= 32), unsigned, unsigned long long>;
  using Table = std::conditional_t<(TABLE_BITS <= 32), unsigned, unsigned long long>;  // a channel's, built
  static constexpr int WORD_BITS = 8 * sizeof(Word);
  static constexpr int CHANNELS_A_WORD = WORD_BITS / TABLE_BITS;
  static constexpr int WORDS = L::UNIT_CHANNELS / CHANNELS_A_WORD;
  static constexpr Word IDENTITY = identity_tables<Word, BITS>();
  Word tables[WORDS][32 / L::G];
  uint8_t jobs[D];  // the widened channels (lane * CPL + k), channel k of every lane before k + 1

  // channel u of the pos-th unit takes table t
  __device__ void put(int u, int pos, Table t) {
    if constexpr (CHANNELS_A_WORD == 1) tables[u][pos] = t;
    else reinterpret_cast<uint8_t*>(&tables[u / CHANNELS_A_WORD][pos])[u % CHANNELS_A_WORD] = uint8_t(t);
  }
};

// At 8 bits, where a table's 256 divides would outnumber a block's rows, value by value, testing each
// channel of the unit: which lanes widened which of their channels.
template <int BITS, int D>
struct Requantize<BITS, D, false> {
  unsigned widened[32];  // a lane's bit k: its channel k widened
};

// Per-warp scratch of the append: each channel's stored grid and the grid it takes, how the
// earlier codes of the storage units that hold a widened channel are requantized, and those units.
template <int BITS, int D>
struct AppendScratch {
  float4 grid[D];  // (zero, step, widened zero, widened step)
  Requantize<BITS, D> requantize;
  uint8_t units[32];
};

// One token appended at block offset off > 0 to stored rows, statistics per channel (decoding).
// Append rule: a channel whose new value falls on its stored grid keeps grid and earlier codes;
// any other widens to span its stored grid and the new value (and a margin past it, widened_span),
// and its earlier codes are requantized onto the widened grid, every row on its own
// (docs/formats.md). At 2 and 4 bits a requantized code depends on the old code alone, so each
// channel of a widened unit gets a table of new code by old code (Requantize), built with the same
// arithmetic (the identity where the channel keeps its grid), and the earlier rows are mapped
// through it.
template <typename T, int BITS, int D>
__device__ void append_per_channel(const Tensor& t, int64_t i, uint8_t* page, int h, int off, int BLOCK, int lane,
                                   AppendScratch<BITS, D>& s) {
  using L = Lanes<BITS, D>;
  using Word = typename L::Word;
  float x[L::CPL];
  load_row<T, D>(static_cast<const T*>(t.src) + i * t.src_stride + h * D, lane, x);
  uint8_t* stats = page + (h * D + lane * L::CPL) * 2;
  float zero[L::CPL], step[L::CPL];
#pragma unroll
  for (int k = 0; k < L::CPL; ++k) {
    zero[k] = load_half(stats + t.zero + 2 * k);
    step[k] = load_half(stats + t.scale + 2 * k);
  }
  unsigned widened = 0;  // bit k: this lane's channel k widens
  Word w = 0;            // the new row's codes
#pragma unroll
  for (int k = 0; k < L::CPL; ++k) {
    const float q = code_on(x[k], zero[k], step[k]);
    const bool widen = q < 0.f || q > L::TOP;
    const float2 span = widened_span(x[k], x[k], zero[k], __fadd_rn(zero[k], __fmul_rn(step[k], L::TOP)));
    const float2 wide = min_max_stats(span.x, span.y, L::TOP);
    s.grid[lane * L::CPL + k] = make_float4(zero[k], step[k], wide.x, wide.y);
    widened |= unsigned(widen) << k;
    w |= Word(widen ? clamped_code(x[k], wide.x, wide.y, L::TOP) : unsigned(q)) << L::shift(lane, k);
  }
  w = L::gather(w);
  uint8_t* head_rows = page + t.codes + int64_t(h) * BLOCK * t.row_bytes;
  if (lane % L::G == 0) L::store(head_rows + int64_t(off) * t.row_bytes + (lane / L::G) * L::UNIT_BYTES, w);
  const bool unit_widened = L::gather(widened) != 0;  // (a unit's lanes OR'd)
  const unsigned leaders = __ballot_sync(kAll, lane % L::G == 0 && unit_widened);
  if (leaders == 0) return;  // the common case: every value on its grid
  using R = Requantize<BITS, D>;
  R& r = s.requantize;
  if constexpr (BITS > 4) r.widened[lane] = widened;
  if (lane % L::G == 0 && unit_widened) s.units[__popc(leaders & ((1u << lane) - 1))] = lane / L::G;
  const int count = __popc(leaders);
  if constexpr (BITS <= 4) {
    // the units' tables start as the identity (a channel that keeps its grid); the widened channels
    // are listed, the jobs of the build
    if (lane < count) {
#pragma unroll
      for (int word = 0; word < R::WORDS; ++word) r.tables[word][lane] = R::IDENTITY;
    }
    int job_count = 0;
#pragma unroll
    for (int k = 0; k < L::CPL; ++k) {
      const bool widen = (widened >> k) & 1;
      const unsigned widening = __ballot_sync(kAll, widen);
      if (widen) r.jobs[job_count + __popc(widening & ((1u << lane) - 1))] = lane * L::CPL + k;
      job_count += __popc(widening);
    }
    __syncwarp();
    // a job's table by a team of lanes, as many as let every job of a round fit the warp (a lane an
    // entry at most): each lane works out `share` consecutive entries, so a round's divides are as
    // few as the warp allows, and the team ORs them together
    const int team_bits = min(BITS, max(0, __clz(job_count - 1) - 27));  // log2 of 32 / job_count, rounded down
    const int team = 1 << team_bits, share = (1 << BITS) >> team_bits, first_code = lane % team * share;
    for (int first = 0; first < job_count; first += 32 >> team_bits) {
      const int job = first + (lane >> team_bits);
      const int c = job < job_count ? r.jobs[job] : 0;  // the job's channel
      typename R::Table table = 0;
      if (job < job_count) {
        const float4 g = s.grid[c];
        for (int q = first_code; q < first_code + share; ++q)
          table |= typename R::Table(clamped_code(decoded(q, g.x, g.y), g.z, g.w, L::TOP)) << (q * BITS);
      }
      for (int o = 1; o < team; o <<= 1) table |= __shfl_xor_sync(kAll, table, o);
      if (job < job_count && lane % team == 0) {
        const int unit = c / L::UNIT_CHANNELS;
        r.put(c % L::UNIT_CHANNELS, __popc(leaders & ((1u << unit * L::G) - 1)), table);
      }
    }
  }
  __syncwarp();
  // earlier rows of the widened units: (row, unit) pairs dealt out over the lanes, item row * count
  // + pos the row's pos-th widened unit, stepped 32 items at a time rather than divided out
  const int rows_a_step = 32 / count, pos_a_step = 32 % count;
  const auto advance = [&](int& row, int& pos) {
    row += rows_a_step, pos += pos_a_step;
    if (pos >= count) pos -= count, ++row;
  };
  const auto unit_at = [&](int row, int pos) {
    return head_rows + row * t.row_bytes + s.units[pos] * L::UNIT_BYTES;
  };
  int row = lane / count, pos = lane % count;  // the lane's next item
  while (row < off) {
    Word codes[kAppendUnroll];
    int fetch_row = row, fetch_pos = pos;
#pragma unroll
    for (int j = 0; j < kAppendUnroll; ++j, advance(fetch_row, fetch_pos))
      if (fetch_row < off) codes[j] = L::load(unit_at(fetch_row, fetch_pos));
#pragma unroll
    for (int j = 0; j < kAppendUnroll; ++j, advance(row, pos)) {
      if (row >= off) continue;
      Word c = codes[j];  // the old codes in, the new ones out
      if constexpr (BITS <= 4) {
        c = 0;
#pragma unroll
        for (int u = 0; u < L::UNIT_CHANNELS; ++u) {
          const unsigned q = unsigned(codes[j] >> (u * BITS)) & L::MASK;
          const auto table = r.tables[u / R::CHANNELS_A_WORD][pos];
          c |= Word(unsigned(table >> (u % R::CHANNELS_A_WORD * R::TABLE_BITS + q * BITS)) & L::MASK)
               << (u * BITS);
        }
      } else {
        const int unit = s.units[pos];
#pragma unroll
        for (int u = 0; u < L::UNIT_CHANNELS; ++u) {
          const int owner = unit * L::G + u / L::CPL;
          if (!((r.widened[owner] >> (u % L::CPL)) & 1)) continue;
          const float4 g = s.grid[unit * L::UNIT_CHANNELS + u];
          const float value = decoded(unsigned(c >> (u * BITS)) & L::MASK, g.x, g.y);
          c = (c & ~(Word(L::MASK) << (u * BITS))) | (Word(clamped_code(value, g.z, g.w, L::TOP)) << (u * BITS));
        }
      }
      L::store(unit_at(row, pos), c);
    }
  }
#pragma unroll
  for (int k = 0; k < L::CPL; ++k) {
    if (!((widened >> k) & 1)) continue;
    const float4 g = s.grid[lane * L::CPL + k];
    store_half(stats + t.scale + 2 * k, g.w);
    store_half(stats + t.zero + 2 * k, g.z);
  }
}

// Several new tokens in a block, statistics per channel (a prompt's block, or a chunk appended to
// stored rows): new rows first..last, row r the batch's token row0 + r. The block's chunks of 4
// channels are dealt out over the warps of its last `dealers` new tokens (this one is `rank`), a
// lane a row. Per channel: the new rows' statistics, widened to span the stored grid (and a margin
// past it) where there are stored rows (first > 0); a channel whose new values all fall on its
// stored grid keeps grid and earlier codes.
template <typename T, int BITS, int D>
__device__ void encode_chunks(const Tensor& t, int row0, int first, int last, int rank, int dealers, uint8_t* page,
                              int h, int BLOCK, int lane) {
  using C = Lanes<BITS, 128>;  // a chunk is the unit of a lane that holds 4 channels
  using Word = typename C::Word;
  constexpr int CC = 4;
  // new rows a lane keeps in registers between the two passes (its first ones; a 64-token block's
  // all): two where that stays under the kernel's register budget without spilling, else one
  constexpr int kKeptRows = BITS * D > 1024 ? 1 : 2;
  const bool has_old = first > 0;
  const T* src = static_cast<const T*>(t.src) + h * D;
  uint8_t* head_rows = page + t.codes + int64_t(h) * BLOCK * t.row_bytes;
  for (int chunk = rank; chunk < D / CC; chunk += dealers) {
    const int c0 = chunk * CC;
    uint8_t* stats = page + (h * D + c0) * 2;
    float zero[CC], step[CC], lo[CC], hi[CC], x[CC];
    unsigned off_grid = 0;  // bit k: a new value of channel k falls off its stored grid
#pragma unroll
    for (int k = 0; k < CC; ++k) {
      zero[k] = has_old ? load_half(stats + t.zero + 2 * k) : 0.f;
      step[k] = has_old ? load_half(stats + t.scale + 2 * k) : 1.f;
      lo[k] = INFINITY, hi[k] = -INFINITY;
    }
    // row r's values of the chunk's channels
    const auto load_chunk = [&](int r, float (&v)[CC]) {
#pragma unroll
      for (int k = 0; k < CC; ++k) v[k] = to_float(src[int64_t(row0 + r) * t.src_stride + c0 + k]);
    };
    // a new row's values into the statistics; whether they fall on the stored grid only where there is one
    const auto take = [&](const float (&v)[CC]) {
#pragma unroll
      for (int k = 0; k < CC; ++k) {
        lo[k] = fminf(lo[k], v[k]), hi[k] = fmaxf(hi[k], v[k]);
        if (has_old) {
          const float q = code_on(v[k], zero[k], step[k]);
          off_grid |= unsigned(q < 0.f || q > C::TOP) << k;
        }
      }
    };
    // the lane's new rows r, each with where its values are: kept (a lane's first kKeptRows rows,
    // loaded by the first pass, read again by the second) or x (loaded by each pass)
    float kept[kKeptRows][CC];
    const auto each_new_row = [&](auto&& visit) {
#pragma unroll
      for (int j = 0; j < kKeptRows; ++j) {
        const int r = first + lane + 32 * j;
        if (r > last) break;
        visit(r, kept[j], true);
      }
      for (int r = first + lane + 32 * kKeptRows; r <= last; r += 32) visit(r, x, false);
    };
    each_new_row([&](int r, float (&v)[CC], bool) {
      load_chunk(r, v);
      take(v);
    });
    for (int o = 16; o > 0; o >>= 1) {
      off_grid |= __shfl_xor_sync(kAll, off_grid, o);
#pragma unroll
      for (int k = 0; k < CC; ++k) {
        lo[k] = fminf(lo[k], __shfl_xor_sync(kAll, lo[k], o));
        hi[k] = fmaxf(hi[k], __shfl_xor_sync(kAll, hi[k], o));
      }
    }
    if (!has_old) off_grid = (1u << CC) - 1;  // no stored grid: every channel takes its rows' own
    float new_zero[CC], new_step[CC];
#pragma unroll
    for (int k = 0; k < CC; ++k) {
      new_zero[k] = zero[k], new_step[k] = step[k];
      if (!((off_grid >> k) & 1)) continue;
      if (has_old) {
        const float2 span = widened_span(lo[k], hi[k], zero[k], __fadd_rn(zero[k], __fmul_rn(step[k], C::TOP)));
        lo[k] = span.x, hi[k] = span.y;
      }
      const float2 g = min_max_stats(lo[k], hi[k], C::TOP);
      new_zero[k] = g.x, new_step[k] = g.y;
    }
    // the stored rows: their codes move to the new grid where their channel's grid changed
    for (int r = lane; r < first; r += 32) {
      uint8_t* unit = head_rows + r * t.row_bytes + chunk * C::UNIT_BYTES;
      const Word old = C::load(unit);
      Word w = 0;
#pragma unroll
      for (int k = 0; k < CC; ++k) {
        unsigned code = unsigned(old >> (k * BITS)) & C::MASK;
        if ((off_grid >> k) & 1)
          code = clamped_code(decoded(code, zero[k], step[k]), new_zero[k], new_step[k], C::TOP);
        w |= Word(code) << (k * BITS);
      }
      C::store(unit, w);
    }
    // the new rows, on the new grid
    const auto store_codes = [&](int r, const float (&v)[CC]) {
      Word w = 0;
#pragma unroll
      for (int k = 0; k < CC; ++k) w |= Word(clamped_code(v[k], new_zero[k], new_step[k], C::TOP)) << (k * BITS);
      C::store(head_rows + r * t.row_bytes + chunk * C::UNIT_BYTES, w);
    };
    each_new_row([&](int r, float (&v)[CC], bool is_kept) {
      if (!is_kept) load_chunk(r, v);
      store_codes(r, v);
    });
#pragma unroll
    for (int k = 0; k < CC; ++k) {
      if (lane != k) continue;
      store_half(stats + t.scale + 2 * k, new_step[k]);
      store_half(stats + t.zero + 2 * k, new_zero[k]);
    }
  }
}

// The first token of a block (no stored rows), statistics per channel: each channel's grid is its
// one value's, as encode_chunks would give it (same arithmetic), but with a lane a chunk of 4
// channels, so the row takes one pass; dealt to its one warp, encode_chunks takes its 32 chunks one
// after another, each waiting on its own load, and a decode step's write waits on that warp
// whenever any of its requests starts a block (docs/benchmarks.md).
template <typename T, int BITS, int D>
__device__ void first_row_per_channel(const Tensor& t, int64_t i, uint8_t* page, int h, int BLOCK, int lane) {
  using C = Lanes<BITS, 128>;  // a chunk: the unit of a lane that holds 4 channels
  using Word = typename C::Word;
  constexpr int CC = 4;
  const T* src = static_cast<const T*>(t.src) + i * t.src_stride + h * D;
  uint8_t* row = page + t.codes + int64_t(h) * BLOCK * t.row_bytes;
  for (int chunk = lane; chunk < D / CC; chunk += 32) {
    const int c0 = chunk * CC;
    uint8_t* stats = page + (h * D + c0) * 2;
    float x[CC];
#pragma unroll
    for (int k = 0; k < CC; ++k) x[k] = to_float(src[c0 + k]);
    Word w = 0;
#pragma unroll
    for (int k = 0; k < CC; ++k) {
      const float2 g = min_max_stats(x[k], x[k], C::TOP);
      w |= Word(clamped_code(x[k], g.x, g.y, C::TOP)) << (k * BITS);
      store_half(stats + t.scale + 2 * k, g.y);
      store_half(stats + t.zero + 2 * k, g.x);
    }
    C::store(row + chunk * C::UNIT_BYTES, w);
  }
}

// How many tokens right after token i in the batch (step 1), or right before it (step -1), hold the
// slots next to i's in the same direction, counted up to `limit`, 32 at a time; `near` is this
// lane's slots[i + step * (lane + 1)] (-1 past the batch), loaded by the caller with its other loads.
__device__ int run_of_slots(const int64_t* slots, int n, int i, int slot, int step, int limit, int64_t near,
                            int lane) {
  for (int d0 = 1; d0 <= limit; d0 += 32) {
    const int d = d0 + lane, j = i + step * d;
    if (d0 > 1) near = j >= 0 && j < n ? slots[j] : -1;
    const unsigned held = __ballot_sync(kAll, d <= limit && near == int64_t(slot) + step * d);
    if (held != kAll) return d0 - 1 + __ffs(~held) - 1;
  }
  return limit;
}

constexpr int kDealers = 32;  // a block's last new tokens whose warps share its encode

// Warp w of block b takes work item b * kWarps + w: (token, KV head, tensor), the tensor fastest.
template <typename T, int BITS, int D>
__global__ void __launch_bounds__(kWarps * 32, 6)
    write_kernel(Tensor a, Tensor b, int num_tensors, const int64_t* __restrict__ slots, uint8_t* cache,
                 int num_tokens, int H, int64_t page_bytes, int BLOCK) {
  __shared__ AppendScratch<BITS, D> scratch[kWarps];
  kvc::allow_next_grid();  // the decode after may set up while this writes
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int item = blockIdx.x * kWarps + warp;
  if (item >= num_tokens * H * num_tensors) return;
  const Tensor t = item % num_tensors == 0 ? a : b;
  const int i = item / num_tensors / H, h = item / num_tensors % H;
  const bool per_channel = t.token_group == 0;
  // the slots right after and before token i, loaded with its own (per-channel statistics only)
  const int64_t next = per_channel && i + 1 + lane < num_tokens ? slots[i + 1 + lane] : -1;
  const int64_t prev = per_channel && i - 1 - lane >= 0 ? slots[i - 1 - lane] : -1;
  const int64_t slot64 = slots[i];
  if (slot64 < 0) return;
  const int slot = int(slot64), off = slot % BLOCK;
  uint8_t* page = cache + int64_t(slot / BLOCK) * page_bytes;
  if (!per_channel) {
    kvc::wait_for_prior_grid();  // the new tokens, from the kernel before
    return write_row_per_token<T, BITS, D>(t, i, page, h, off, BLOCK, lane);
  }
  // the block's new rows are first..last: a request's new tokens are consecutive in the batch and
  // in their slots. Tokens further than kDealers from the last have no work here.
  const int ahead = run_of_slots(slots, num_tokens, i, slot, 1, min(BLOCK - 1 - off, kDealers), next, lane);
  if (ahead >= kDealers) return;
  const int first = off - run_of_slots(slots, num_tokens, i, slot, -1, off, prev, lane), last = off + ahead;
  kvc::wait_for_prior_grid();
  if (first == last && off > 0)
    append_per_channel<T, BITS, D>(t, i, page, h, off, BLOCK, lane, scratch[warp]);
  else if (first == last)
    first_row_per_channel<T, BITS, D>(t, i, page, h, BLOCK, lane);
  else
    encode_chunks<T, BITS, D>(t, i - off, first, last, ahead, min(last - first + 1, kDealers), page, h, BLOCK, lane);
}

// Launched to read its slots while the kernel before it ends (dependent_launch.cuh)
template <typename T, int BITS, int D>
cudaError_t launch(const Tensor& a, const Tensor& b, int num_tensors, const int64_t* slots, uint8_t* cache, int n,
                   int H, int64_t page_bytes, int BLOCK, cudaStream_t stream) {
  const int items = n * H * num_tensors;
  return kvc::launch_dependent(write_kernel<T, BITS, D>, dim3((items + kWarps - 1) / kWarps), dim3(kWarps * 32),
                               stream, a, b, num_tensors, slots, cache, n, H, page_bytes, BLOCK);
}

using Launcher = cudaError_t (*)(const Tensor&, const Tensor&, int, const int64_t*, uint8_t*, int, int, int64_t, int,
                          cudaStream_t);

template <typename T, int D>
Launcher launcher_of_bits(int bits) {
  return bits == 2 ? launch<T, 2, D> : bits == 4 ? launch<T, 4, D> : bits == 8 ? launch<T, 8, D> : nullptr;
}

template <typename T>
Launcher launcher_of(int head_size, int bits) {
  return head_size == 64    ? launcher_of_bits<T, 64>(bits)
         : head_size == 128 ? launcher_of_bits<T, 128>(bits)
         : head_size == 256 ? launcher_of_bits<T, 256>(bits)
                            : nullptr;
}

}  // namespace

// A write's arguments, one struct so that the caller (ctypes) converts one pointer a call rather
// than 25 values; cuda_write.py's _WriteArgs mirrors it field for field.
struct WriteArgs {
  int num_tensors;  // 1 or 2: a (K, or the only tensor), and b (V where it has K's width)
  Tensor a, b;      // each from its source [N, H, head_size] with its page layout (token_group 0: per channel)
  const void* slots;  // [N] int64 (-1: skip)
  void* cache;        // [num_blocks, page_bytes] uint8
  int num_tokens, num_heads, head_size;
  int64_t page_bytes;
  int block_size, bits;
  int dtype;  // of the sources: 0 float32, 1 float16, 2 bfloat16
  void* stream;  // a cudaStream_t
};

// One or two tensors of the pages at `bits` bits. Returns a cudaError_t (cudaErrorInvalidValue for
// what the kernel does not cover).
extern "C" int kvc_write(const WriteArgs* w) {
  const Launcher f = w->dtype == 0   ? launcher_of<float>(w->head_size, w->bits)
                     : w->dtype == 1 ? launcher_of<__half>(w->head_size, w->bits)
                     : w->dtype == 2 ? launcher_of<__nv_bfloat16>(w->head_size, w->bits)
                                     : nullptr;
  if (f == nullptr || w->num_tensors < 1 || w->num_tensors > 2) return static_cast<int>(cudaErrorInvalidValue);
  if (w->num_tokens == 0) return 0;
  return static_cast<int>(f(w->a, w->b, w->num_tensors, static_cast<const int64_t*>(w->slots),
                            static_cast<uint8_t*>(w->cache), w->num_tokens, w->num_heads, w->page_bytes,
                            w->block_size, static_cast<cudaStream_t>(w->stream)));
}
