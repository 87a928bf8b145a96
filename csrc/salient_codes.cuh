// ZipCache's two planes of a token's codes (formats/salient.py) joined into its 4-bit codes: a word of
// the high plane (2-bit codes, channel 4b + k in bits 2k of byte b) and the word of its refinement row
// at the same place (the low 2 bits; 0 for a 2-bit token, which then reads KVC_SALIENT_MIDDLE steps
// higher) make two words of nibbles, 4 high + low. What the decode write scores and the decode reads.
#pragma once

#include <stdint.h>

#ifndef KVC_SALIENT_MIDDLE
#error "build through vllm_kvcompress.cuda_jit, which passes the formats' constants"
#endif

namespace kvc {

constexpr float kSalientMiddle = KVC_SALIENT_MIDDLE;  // where a 2-bit token reads among its four sub-levels

// bits of `b` where 0x33333333 has them, else of `a`: one LOP3 (the compiler's own took two)
__device__ __forceinline__ uint32_t select_low_pairs(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xD8;" : "=r"(r) : "r"(a), "r"(b), "r"(0x33333333u));
  return r;
}

// channels 4b (low nibble) and 4b + 2 of byte b
__device__ __forceinline__ uint32_t join_even(uint32_t high, uint32_t low) { return select_low_pairs(high << 2, low); }

// channels 4b + 1 (low nibble) and 4b + 3 of byte b
__device__ __forceinline__ uint32_t join_odd(uint32_t high, uint32_t low) { return select_low_pairs(high, low >> 2); }

}  // namespace kvc
