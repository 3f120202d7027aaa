// The int8-activation quantized linear's AVX2 kernel (linear_qa.h): 16 outputs in two ymm
// registers; vpmaddubsw + vpmaddwd for the integer dot products. int4 nibbles (0..15) are the
// unsigned operand as they are; int8 weights use the sign trick (|x| unsigned times the weight with
// x's sign), whose pair sums (at most 2 * 127 * 127) never saturate vpmaddubsw's int16, so every
// block sum is exact and equals the VNNI kernel's. Compiled without AVX-512 (native/__init__.py).
#include "linear_qa.h"

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
  struct I {
    __m256i a, b;
  };
  using W = I;
  using A = I;  // int4 block sums in int16 lanes, widened once per block (done4)
  struct X {
    __m256i v, abs;  // 4 activation bytes broadcast, and (int8 weights) their absolute values
  };
  static constexpr int kRows = 2;
  static constexpr int64_t kTile = 4;
  static constexpr int nb(int rows) { return rows == 1 ? 4 : 1; }  // one row: 4 weight streams in flight

  QK_TARGET static F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  QK_TARGET static I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  QK_TARGET static F bcast(float v) {
    const __m256 b = _mm256_set1_ps(v);
    return {b, b};
  }
  QK_TARGET static F fma(F x, F y, F c) { return {_mm256_fmadd_ps(x.a, y.a, c.a), _mm256_fmadd_ps(x.b, y.b, c.b)}; }
  QK_TARGET static F mul(F x, F y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
  QK_TARGET static F cvt(I v) { return {_mm256_cvtepi32_ps(v.a), _mm256_cvtepi32_ps(v.b)}; }
  QK_TARGET static void store(float* p, F v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
  }
  QK_TARGET static __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
  QK_TARGET static __m256 load8(const uint16_t* x) {  // bfloat16 -> fp32, exactly
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  QK_TARGET static F scales(const uint8_t* p, int type) {
    F s;
    scales_avx2(p, type, s.a, s.b);
    return s;
  }
  QK_TARGET static __m256i load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  QK_TARGET static W w8(const uint8_t* p) {  // the stored +128 bytes back to signed weights
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    return {_mm256_xor_si256(load(p), flip), _mm256_xor_si256(load(p + 32), flip)};
  }
  QK_TARGET static void w4(const uint8_t* p, W& lo, W& hi) {
    const __m256i low = _mm256_set1_epi8(15), a = load(p), b = load(p + 32);
    lo = {_mm256_and_si256(a, low), _mm256_and_si256(b, low)};
    hi = {_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(_mm256_srli_epi16(b, 4), low)};
  }
  QK_TARGET static __m256i bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  QK_TARGET static X x8(const int8_t* p) {
    const __m256i v = bcast4(p);
    return {v, _mm256_abs_epi8(v)};
  }
  QK_TARGET static X x4(const int8_t* p) { return {bcast4(p), _mm256_setzero_si256()}; }
  QK_TARGET static __m256i pairs(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  QK_TARGET static I dp8(I acc, W w, X x) {
    return {pairs(acc.a, x.abs, _mm256_sign_epi8(w.a, x.v)), pairs(acc.b, x.abs, _mm256_sign_epi8(w.b, x.v))};
  }
  QK_TARGET static A azero() { return izero(); }
  QK_TARGET static A dp4(A acc, W w, X x) {
    return {_mm256_add_epi16(acc.a, _mm256_maddubs_epi16(w.a, x.v)), _mm256_add_epi16(acc.b, _mm256_maddubs_epi16(w.b, x.v))};
  }
  QK_TARGET static I done4(A acc) {
    const __m256i one = _mm256_set1_epi16(1);
    return {_mm256_madd_epi16(acc.a, one), _mm256_madd_epi16(acc.b, one)};
  }
  QK_TARGET static I fix8(I acc, int32_t) { return acc; }  // dp8 used the signed weights

  // Q8_0's rule, as the VNNI kernel's quantize (the same bits: IEEE division, nearest even).
  template <class In>
  QK_TARGET static void quantize(const In* x, int8_t* q, float& d, int32_t& sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    d = amax / 127.0f;
    if (amax == 0.0f) {
      std::memset(q, 0, kActBlock);
      sum = 0;
      return;
    }
    const __m256 dv = _mm256_set1_ps(d);
    __m256i n[4];
    for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], dv));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    sum = _mm_cvtsi128_si32(t);
  }
};
// Unrolled by 2 (int8) and not at all (int4), a block's steps keep to the 16 ymm registers: measured
// 3-9 % faster at 1-16 rows than full unrolling, which spilled the products to the stack.
#define QA_UNROLL_INT8 2
#define QA_UNROLL_INT4 1
#include "linear_qa_kernel.h"
#endif

}  // namespace

void qlinear_a8_avx2(const QCall& call) {
#if defined(FLARE_X86)
  QAKernel<Avx2>::run(call);
#else
  TORCH_CHECK(false, "qlinear: this build has no AVX2 kernel");
#endif
}

}  // namespace flare_native
