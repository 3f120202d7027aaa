// Quantized linears (int8 and int4 weights, group-wise scales; helios/core/quant.py's stored
// layout): pack_qlinear repacks a weight's stored tensors once at load into one uint8 blob, and
// qlinear multiplies float32 or bfloat16 activations by it on AVX-512 or AVX2+FMA.
//
// The blob: a 64-byte header (QHeader), then per block of 16 outputs (outputs past `out` are zero),
// per group of `group` input features, the group's 16 scales (and for int4 its 16 minimums) in the
// header's scale type (ScaleType: float32, bfloat16 or float16), then its weights feature by feature:
//   int8: for each feature k, the 16 outputs' int8 values (16 bytes);
//   int4: for each pair of features (2p, 2p + 1), 16 bytes: output o's byte holds feature 2p in its
//         low nibble and 2p + 1 in its high nibble (the stored qweight byte [o, p] as it is).
// So a block's weights, scales next to them, stream linearly, and one 16-byte load gives the 16
// outputs' weights of a feature (int8) or of a pair of features (int4): one AVX-512 register of
// fp32 outputs, or two AVX2 ones. Scales are widened to float32 exactly; each weight is dequantized
// to exactly the float32 value helios.core.quant.dequantize gives: q * scale, or q * scale + min as
// a product then a sum (one fused multiply-add where the product is exact: bfloat16 or float16 scales). The
// sources are compiled with -ffp-contract=off (native/__init__.py) so that the compiler fuses
// nothing else.
//
// Activations stay float (bfloat16 ones widened exactly) in this layout, the exact path:
// quantizing them to int8 for VNNI does not give the float reference's results, so that is a
// separate layout (pack_qlinear's act_bits=8: linear_qa.h) a core chooses at export. Here many rows run at the fp32 FMA rate of the host (on a
// Zen 4 core about half of what AVX512-BF16's pair dot products give the bfloat16 linear), and one
// row at the rate its dequantizing allows (int8: load, widen, convert, scale; int4 also a nibble
// split and the minimum).
//
// Reduction order: every output of every row is one fp32 fused multiply-add chain over the input
// features in ascending order, starting from 0, then + bias, then rounded to the output dtype. The
// few-row kernel (weights dequantized in registers as they stream) and the many-row kernel (a tile
// of weights dequantized once into L1 and reused by every row) run the same chain, and so do the
// AVX-512 and AVX2 paths: a row's bits depend neither on its neighbours nor on the instruction set.
#pragma once

#include "common.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace flare_native {

// A blob's scales (and minimums) as pack_qlinear was given them: float32, bfloat16, or float16
// (helios.engine.quantized hands float32 scales over as float16 where every one of them is a float16
// value, as a GGUF's are: half the bytes, and each widens back to the same float32 exactly).
enum ScaleType : int32_t { kScaleF32 = 0, kScaleBF16 = 1, kScaleF16 = 2 };

struct QHeader {
  int64_t magic, bits, group, in, out, blocks;
  int32_t scale_bytes, scale_type;
  int64_t block_bytes;
};
static_assert(sizeof(QHeader) == 64, "the blob header is one cache line");

// A blob's header as the kernels read it. Blobs packed by earlier builds (a compiled step holds its
// blobs as constants) kept scale_bytes in all 64 bits: type 0 with 2-byte scales is bfloat16.
inline QHeader read_header(const void* blob) {
  QHeader h;
  std::memcpy(&h, blob, sizeof h);
  if (h.scale_type == kScaleF32 && h.scale_bytes == 2) h.scale_type = kScaleBF16;
  return h;
}
constexpr int64_t kQMagic = 0x31514c46;  // "FLQ1"

#if defined(__x86_64__) || defined(_M_X64)
// 16 of a blob's scales (or minimums) widened exactly to float32 as two 8-lane halves: what both
// AVX2 kernels (linear_q_avx2.cpp, linear_qa_avx2.cpp) read them with.
__attribute__((target("avx2,f16c"))) inline void scales_avx2(const uint8_t* p, int32_t type, __m256& lo, __m256& hi) {
  if (type == kScaleF32) {
    lo = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    hi = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8);
    return;
  }
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  if (type == kScaleF16) {
    lo = _mm256_cvtph_ps(a);
    hi = _mm256_cvtph_ps(b);
  } else {  // bfloat16: the upper half of a float32
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
    hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  }
}
#endif

#if defined(__AVX512F__)
// The same 16 scales (or minimums) in one 16-lane register: what both AVX-512 kernels
// (linear_q.cpp, linear_qa.cpp) read them with.
inline __m512 scales_avx512(const uint8_t* p, int32_t type) {
  if (type == kScaleF32) return _mm512_loadu_ps(p);
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (type == kScaleF16) return _mm512_cvtph_ps(half);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));  // bfloat16
}
#endif

// What a qlinear kernel needs from the call: input rows (fp32; or bfloat16 for the int8-activation
// kernels), output, bias.
struct QCall {
  const QHeader* head;
  const uint8_t* blocks;  // the first block (just past the header)
  const float* x;         // [rows, ldx] fp32
  int64_t rows, ldx;
  const float* bias;  // [out] fp32 or null
  void* y;            // [rows, out] of the output dtype
  bool bf16_out;
  // The int8-activation kernels (linear_qa.h) also read bfloat16 rows in place: xb [rows, ldx]
  // (x null then), widened in registers as they are quantized (exact, as a copy to fp32 is).
  const uint16_t* xb = nullptr;
};

// linear_q.cpp
at::Tensor pack_qlinear(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                        int64_t group, int64_t act_bits);
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                   int64_t out_features);
bool has_qlinear();
bool has_qlinear_avx512();
void qlinear_avx512(const QCall& call);

// linear_q_avx2.cpp
bool has_qlinear_avx2();
void qlinear_avx2(const QCall& call);

}  // namespace flare_native
