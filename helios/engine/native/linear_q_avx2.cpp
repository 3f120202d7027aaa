// qlinear's AVX2+FMA kernel (linear_q.h): a block's 16 outputs in two ymm registers. Every function
// carries target("avx2,fma,f16c") (F16C widens float16 scales; every AVX2 CPU has it), and this
// file is compiled without AVX-512 (native/__init__.py), so an AVX-512 host runs (and tests) what
// an AVX2 host runs; has_qlinear_avx2 asks the CPU at run time.
#include "linear_q.h"

#if defined(__x86_64__) || defined(_M_X64)
#define FLARE_X86 1
#include <immintrin.h>
#define QK_TARGET __attribute__((target("avx2,fma,f16c")))
#endif

namespace flare_native {
namespace {

#if defined(FLARE_X86)
struct Avx2 {
  struct F {
    __m256 a, b;
  };
  // 16 registers: one decode row takes 2 blocks (4 accumulator chains), many rows 6 x 1 block.
  static constexpr int kFewRows = 2, kFewBlocks = 2, kTile = 4, kRows = 6, kMicroBlocks = 1;
  QK_TARGET static F zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  QK_TARGET static F load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  QK_TARGET static void store(float* p, F v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
  }
  QK_TARGET static F bcast(const float* p) {
    const __m256 v = _mm256_broadcast_ss(p);
    return {v, v};
  }
  QK_TARGET static F fma(F x, F w, F c) { return {_mm256_fmadd_ps(x.a, w.a, c.a), _mm256_fmadd_ps(x.b, w.b, c.b)}; }
  QK_TARGET static F mul(F x, F y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
  QK_TARGET static F add(F x, F y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
  QK_TARGET static F scales(const uint8_t* p, int type) {
    F s;
    scales_avx2(p, type, s.a, s.b);
    return s;
  }
  QK_TARGET static __m256 half_i8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  QK_TARGET static F i8(const uint8_t* p) { return {half_i8(p), half_i8(p + 8)}; }
  QK_TARGET static void u4(const uint8_t* p, F& lo, F& hi) {
    const __m256i va = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i vb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const __m256i low = _mm256_set1_epi32(15);
    lo = {_mm256_cvtepi32_ps(_mm256_and_si256(va, low)), _mm256_cvtepi32_ps(_mm256_and_si256(vb, low))};
    hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(va, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(vb, 4))};
  }
};
#include "linear_q_kernel.h"
#endif

}  // namespace

bool has_qlinear_avx2() {
#if defined(FLARE_X86)
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

void qlinear_avx2(const QCall& call) {
#if defined(FLARE_X86)
  QKernel<Avx2>::run(call);
#else
  TORCH_CHECK(false, "qlinear: this build has no AVX2 kernel");
#endif
}

}  // namespace flare_native
