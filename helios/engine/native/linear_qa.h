// Quantized linears with int8 activations (llama.cpp's way): pack_qlinear(..., act_bits=8) lays a
// weight out for integer dot products, and qlinear, given such a blob, quantizes each activation row
// per block of 32 input features to int8 with one fp32 scale (Q8_0's rule: d = amax / 127,
// q = round-to-nearest-even(x / d), q = 0 where amax is 0) and multiplies integers: AVX512-VNNI
// vpdpbusd (unsigned weight bytes times signed activation bytes, 4 per 32-bit lane), or on AVX2
// vpmaddubsw + vpmaddwd. The float-activation blob (linear_q.h) stays the exact path; this one's
// results are those of the quantized activations (helios/engine/quantized_ref.py is its reference).
//
// The blob: the 64-byte QHeader (magic kQMagicA8), then per block of 16 outputs (outputs past `out`
// zero): a scale region of 64-byte multiple size (the block's scales [group][16 outputs] in the
// header's scale type, then for int4 its minimums [group][16]), then its weights, per 32-feature
// activation block kb (a 64/128 weight group spans 2/4 of them), in 64-byte steps of 16 outputs x 4
// bytes (one vpdpbusd operand: output o's 32-bit lane):
//   int8: 8 steps; step s, output o, byte t: weight (o, 32 kb + 4 s + t) + 128 as an unsigned byte;
//   int4: 4 steps; step s, output o, byte t: low nibble weight (o, 32 kb + 4 s + t), high nibble
//         weight (o, 32 kb + 16 + 4 s + t) (q in 0..15, unsigned as stored).
//
// Arithmetic per output o of row r, with w_q the stored integers, s/m the weight group's scale and
// minimum, d[kb] the activation block scales and S[kb] = sum of the block's int8 activations:
//   I[kb]  = sum over the block's 32 features of w_q * x_q (exact in int32; the +128 offset of
//            int8 weights removed as 128 * S[kb], exactly);
//   acc    = 0; for kb ascending: acc = fma(float(I[kb]), s * d[kb], acc);
//            int4 also: acc = fma(m, d[kb] * float(S[kb]), acc);
//   y      = acc (+ bias), rounded to the output dtype.
// The integer sums are exact and the float steps are these fp32 operations in this order on every
// path (AVX512-VNNI and AVX2, few rows and many): a row's bits depend neither on its neighbours, nor
// on the thread count, nor on the instruction set.
#pragma once

#include "linear_q.h"

namespace flare_native {

constexpr int64_t kQMagicA8 = 0x38514c46;  // "FLQ8"
constexpr int64_t kActBlock = 32;          // activation features per int8 scale

// Bytes of one block of 16 outputs in the int8-activation layout.
inline int64_t a8_scale_region(int64_t bits, int64_t group, int64_t in, int64_t scale_bytes) {
  return (kBlock * (in / group) * scale_bytes * (bits == 4 ? 2 : 1) + 63) / 64 * 64;
}
inline int64_t a8_block_bytes(int64_t bits, int64_t group, int64_t in, int64_t scale_bytes) {
  return a8_scale_region(bits, group, in, scale_bytes) + in * kBlock * (bits == 8 ? 1 : 0) +
         in * kBlock / 2 * (bits == 4 ? 1 : 0);
}

// linear_qa.cpp
void pack_one_a8(const uint8_t* q, const uint8_t* s, const uint8_t* m, const QHeader& h, uint8_t* out);
bool has_qlinear_a8_avx512();
// The call's x: float32 [rows, in] rows (ldx apart); each kernel quantizes them, then multiplies.
void qlinear_a8_avx512(const QCall& call);

// linear_qa_avx2.cpp
void qlinear_a8_avx2(const QCall& call);

}  // namespace flare_native
