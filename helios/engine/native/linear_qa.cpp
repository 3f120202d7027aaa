// The int8-activation quantized linear (linear_qa.h): its blob layout (pack_one_a8, called by
// pack_qlinear) and its AVX512-VNNI kernel: vpdpbusd takes the weights' unsigned bytes (int4's
// nibbles as they are, int8's with +128, removed afterwards as 128 * S) times the activations'
// signed ones, 16 outputs x 4 features per instruction.
#include "linear_qa.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FLARE_QA_VNNI 1
#include <immintrin.h>
#endif

namespace flare_native {
namespace {

#if defined(FLARE_QA_VNNI)
#define QK_TARGET
struct Vnni {
  using F = __m512;
  using I = __m512i;
  using W = __m512i;
  using X = __m512i;
  using A = __m512i;
  static constexpr int kRows = 4;
  static constexpr int64_t kTile = 4;  // blocks whose weights every register block of rows reuses
  static constexpr int nb(int rows) { return rows == 1 ? 4 : 2; }

  static F fzero() { return _mm512_setzero_ps(); }
  static I izero() { return _mm512_setzero_si512(); }
  static F bcast(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F scales(const uint8_t* p, bool bf16) {
    if (!bf16) return _mm512_loadu_ps(p);
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static W w8(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static void w4(const uint8_t* p, W& lo, W& hi) {
    const __m512i v = _mm512_loadu_si512(p), low = _mm512_set1_epi8(15);
    lo = _mm512_and_si512(v, low);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  }
  static X x8(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static X x4(const int8_t* p) { return x8(p); }
  static I dp8(I acc, W w, X x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static A azero() { return _mm512_setzero_si512(); }
  static A dp4(A acc, W w, X x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static I done4(A acc) { return acc; }
  static I fix8(I acc, int32_t sum) { return _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * sum)); }

  // Q8_0's rule: d = amax / 127; q = x / d rounded to nearest even (the default rounding mode);
  // an all-zero block gets d = 0 and q = 0.
  static __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
  static __m512 load16(const uint16_t* x) {  // bfloat16 -> fp32, exactly
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  template <class In>
  static void quantize(const In* x, int8_t* q, float& d, int32_t& sum) {
    const __m512 a = load16(x), b = load16(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    d = amax / 127.0f;
    if (amax == 0.0f) {
      std::memset(q, 0, kActBlock);
      sum = 0;
      return;
    }
    const __m512 dv = _mm512_set1_ps(d);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_div_ps(a, dv)), qb = _mm512_cvtps_epi32(_mm512_div_ps(b, dv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
    sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  }
};
#include "linear_qa_kernel.h"
#endif

}  // namespace

bool has_qlinear_a8_avx512() {
#if defined(FLARE_QA_VNNI)
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

void qlinear_a8_avx512(const QCall& call) {
#if defined(FLARE_QA_VNNI)
  QAKernel<Vnni>::run(call);
#else
  TORCH_CHECK(false, "qlinear: this build has no AVX512-VNNI kernel");
#endif
}

// stored [out, cols] -> the blob bytes of one weight in the int8-activation layout (linear_qa.h).
void pack_one_a8(const uint8_t* q, const uint8_t* s, const uint8_t* m, const QHeader& h, uint8_t* out) {
  std::memcpy(out, &h, sizeof h);
  const int64_t sb = h.scale_bytes, groups = h.in / h.group, nkb = h.in / kActBlock;
  const int64_t region = a8_scale_region(h.bits, h.group, h.in, sb), qcols = h.bits == 8 ? h.in : h.in / 2;
  at::parallel_for(0, h.blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint8_t* block = out + sizeof(QHeader) + b * h.block_bytes;
      std::memset(block, 0, h.block_bytes);
      for (int64_t o = 0; o < kBlock; ++o) {
        const int64_t row = b * kBlock + o;
        if (row >= h.out) break;
        for (int64_t g = 0; g < groups; ++g) {
          std::memcpy(block + (g * kBlock + o) * sb, s + (row * groups + g) * sb, sb);
          if (m != nullptr) std::memcpy(block + ((groups + g) * kBlock + o) * sb, m + (row * groups + g) * sb, sb);
        }
        const uint8_t* src = q + row * qcols;
        for (int64_t kb = 0; kb < nkb; ++kb) {
          if (h.bits == 8) {
            uint8_t* dst = block + region + kb * 512 + o * 4;
            for (int64_t f = 0; f < kActBlock; ++f) dst[f / 4 * 64 + f % 4] = src[kb * kActBlock + f] ^ 0x80;  // + 128
          } else {
            uint8_t* dst = block + region + kb * 256 + o * 4;
            const uint8_t* pairs = src + kb * kActBlock / 2;  // feature 2i low nibble, 2i + 1 high
            auto nibble = [&](int64_t f) { return f % 2 ? pairs[f / 2] >> 4 : pairs[f / 2] & 15; };
            for (int64_t f = 0; f < 16; ++f) dst[f / 4 * 64 + f % 4] = nibble(f) | nibble(16 + f) << 4;
          }
        }
      }
    }
  });
}

}  // namespace flare_native
