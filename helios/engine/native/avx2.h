// What the AVX2+FMA sources share: the x86 test, the target attribute that gives a function AVX2
// and FMA whatever -march the library is built with (has_avx2_linear asks the CPU at run time),
// and exp on 8 lanes.
#pragma once

#include "common.h"

#if defined(__x86_64__) || defined(_M_X64)
#define FLARE_X86 1
#include <immintrin.h>
#define FLARE_AVX2 __attribute__((target("avx2,fma")))

namespace flare_native {

// exp(x) for x <= 0 on 8 lanes: common.h's exp_nonpositive (the same polynomial, kExpFraction, with
// fused multiply-adds); inputs below -87 count as -87.
FLARE_AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExpFraction[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpFraction[i]));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

}  // namespace flare_native
#endif
