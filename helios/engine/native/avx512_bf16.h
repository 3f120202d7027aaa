// The AVX512-BF16 register micro-kernel shared by linear_avx512.cpp and attention_tiles.cpp: up to 6
// rows x NB blocks of 16 outputs of fp32 accumulators, fed by pack_linear's layout (per block, each
// pair of input features holds the 16 outputs' two weights side by side: what VDPBF16PS reads).
// Present only where the compiler targets AVX512-BF16.
#pragma once

#include "common.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace flare_native {

// Up to 6 rows x NB blocks of 16 outputs, block j's weights at w[j] (pack_linear's layout within
// a block; a 64-key tile's blocks may lie in four pages).
template <int MR, int NB>
inline void micro_at(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t pairs, float* out) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    __m512bh b[NB];
    for (int j = 0; j < NB; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w[j] + k * 2 * kBlock);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * k, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, b[j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + (m * NB + j) * kBlock, acc[m][j]);
}

// micro over pack_linear's layout: block j's weights `pairs * 2 * kBlock` elements after block j - 1's.
template <int MR, int NB>
inline void micro(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, float* out) {
  const uint16_t* blocks[NB];
  for (int j = 0; j < NB; ++j) blocks[j] = w + j * pairs * 2 * kBlock;
  micro_at<MR, NB>(x, ldx, blocks, pairs, out);
}

// One row's 16 fp32 results of block `first / 16` (+ bias), rounded to bfloat16 (nearest even, as
// torch's cast) into out[first:], masked past n.
inline void store_block(const float* acc, const float* bias, int64_t first, int64_t n, uint16_t* out) {
  __m512 v = _mm512_loadu_ps(acc);
  const __mmask16 keep = n - first >= kBlock ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - first)) - 1);
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + first));
  _mm256_mask_storeu_epi16(out + first, keep, (__m256i)_mm512_cvtneps_pbh(v));
}

}  // namespace flare_native
#endif
