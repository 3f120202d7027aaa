// Quantized linears with int8 activations (llama.cpp's way): pack_qlinear(..., act_bits=8) lays a
// weight out for integer dot products, and qlinear, given such a blob, quantizes each activation row
// per block of 32 input features to int8 with one fp32 scale (Q8_0's rule: d = amax / 127,
// q = round-to-nearest-even(x / d), q = 0 where amax is 0) and multiplies integers: AVX512-VNNI
// vpdpbusd (unsigned weight bytes times signed activation bytes, 4 per 32-bit lane), or on AVX2
// vpmaddubsw + vpmaddwd. The float-activation blob (linear_q.h) stays the exact path; this one's
// results are those of the quantized activations (helios/engine/quantized_ref.py is its reference).
//
// The blob: the 64-byte QHeader, then per block of 16 outputs (outputs past `out` zero) its weight
// groups in order, a few at a time: a 64-byte line of their scales ([groups][16 outputs] in the
// header's scale type; for int4 then their minimums [groups][16]) followed by their weights. So a
// block is one stream, its scales read on the way. As many groups share a line as fill it (float16
// or bfloat16 scales: 2 groups of int8, 1 of int4; float32: 1 group, int4's taking 2 lines); the
// last line of a block may hold fewer. A group's weights, per 32-feature activation block kb (a
// 64/128 weight group spans 2/4 of them), are 64-byte steps of 16 outputs x 4 bytes (one vpdpbusd
// operand: output o's 32-bit lane):
//   int8: 8 steps; step s, output o, byte t: weight (o, 32 kb + 4 s + t) + 128 as an unsigned byte;
//   int4: 4 steps; step s, output o, byte t: low nibble weight (o, 32 kb + 4 s + t), high nibble
//         weight (o, 32 kb + 16 + 4 s + t) (q in 0..15, unsigned as stored).
// Blobs of earlier builds (magic kQMagicA8; a compiled step holds its blobs as constants, so they
// are still read) keep all of a block's scales in one region at its start (all scales [group][16],
// then int4's minimums [group][16], padded to 64 bytes), then all its weights: A8Geom describes
// both.
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

constexpr int64_t kQMagicA8 = 0x38514c46;   // "FLQ8": a block's scales in one region (earlier builds)
constexpr int64_t kQMagicA8L = 0x39514c46;  // "FLQ9": scales beside their groups' weights
constexpr int64_t kActBlock = 32;           // activation features per int8 scale

inline bool is_a8(int64_t magic) { return magic == kQMagicA8 || magic == kQMagicA8L; }
inline int64_t pad64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// Where a block's data lies, for either layout: groups gather in chunks of `per_chunk` groups, each
// chunk `stride` bytes: `head` bytes of scales (group i of the chunk's 16 scales at i * 16 * scale
// bytes, its minimums `mins` bytes further), then the chunk's weights (kb_bytes per 32-feature
// activation block). The earlier layout is one chunk of every group.
struct A8Geom {
  int64_t per_chunk, head, stride, mins, kb_bytes;
  A8Geom(int64_t magic, int64_t bits, int64_t group, int64_t in, int64_t scale_bytes) {
    const int64_t groups = in / group, line = kBlock * scale_bytes * (bits == 4 ? 2 : 1);  // one group's
    kb_bytes = bits == 4 ? 256 : 512;
    per_chunk = magic == kQMagicA8 ? groups : std::max<int64_t>(1, 64 / line);
    head = pad64(per_chunk * line);
    stride = head + per_chunk * group / kActBlock * kb_bytes;
    mins = per_chunk * kBlock * scale_bytes;
  }
  explicit A8Geom(const QHeader& h) : A8Geom(h.magic, h.bits, h.group, h.in, h.scale_bytes) {}
  // Bytes of one block (the header's block_bytes).
  int64_t block_bytes(int64_t groups) const {
    const int64_t chunks = (groups + per_chunk - 1) / per_chunk;
    return chunks * head + groups * (stride - head) / per_chunk;
  }
  // Group g's scales, and activation block kb's weights (kb in group g), from a block's start.
  int64_t scales_at(int64_t g, int64_t scale_bytes) const {
    return g / per_chunk * stride + g % per_chunk * kBlock * scale_bytes;
  }
  int64_t weights_at(int64_t g, int64_t kb, int64_t per_group) const {
    const int64_t c = g / per_chunk;
    return c * stride + head + (kb - c * per_chunk * per_group) * kb_bytes;
  }
};

// The same offsets group after group, without a division per group: what the kernels' loops use.
struct A8Walk {
  const A8Geom& geo;
  int64_t base = 0, slot = 0;  // the group's chunk, and its place in the chunk
  int64_t scales(int64_t scale_bytes) const { return base + slot * kBlock * scale_bytes; }
  // The weights of the group's activation block `kb_in_group` (0 .. group / 32 - 1).
  int64_t weights(int64_t kb_in_group, int64_t per_group) const {
    return base + geo.head + (slot * per_group + kb_in_group) * geo.kb_bytes;
  }
  void next() {
    if (++slot == geo.per_chunk) {
      slot = 0;
      base += geo.stride;
    }
  }
};

// linear_qa.cpp
void pack_one_a8(const uint8_t* q, const uint8_t* s, const uint8_t* m, const QHeader& h, uint8_t* out);
bool has_qlinear_a8_avx512();
// The call's x: float32 [rows, in] rows (ldx apart); each kernel quantizes them, then multiplies.
void qlinear_a8_avx512(const QCall& call);

// linear_qa_avx2.cpp
void qlinear_a8_avx2(const QCall& call);

}  // namespace flare_native
