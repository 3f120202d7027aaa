// The int8-activation quantized linear (linear_qa.h): its blob layout (pack_one_a8, called by
// pack_qlinear) and its AVX512-VNNI kernel: vpdpbusd takes the weights' unsigned bytes (int4's
// nibbles as they are, int8's with +128, removed afterwards as 128 * S) times the activations'
// signed ones, 16 outputs x 4 features per instruction; and qembedding_a8, a tied table's rows read
// back from that blob.
#include "linear_qa.h"

#include <torch/library.h>

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
  // up to 2 rows (one decode row, or a logits row and its copy: rows.py) take 4 weight streams
  static constexpr int nb(int rows) { return rows <= 2 ? 4 : 2; }

  static F fzero() { return _mm512_setzero_ps(); }
  static I izero() { return _mm512_setzero_si512(); }
  static F bcast(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F load16(const float* x) { return _mm512_loadu_ps(x); }
  static F load16(const uint16_t* x) {  // bfloat16 -> fp32, exactly
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static F scales(const uint8_t* p, int type) { return scales_avx512(p, type); }
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

// stored [out, cols] -> the blob bytes of one weight in the int8-activation layout of h.magic
// (linear_qa.h). `out` holds h.blocks * h.block_bytes zero bytes past the header.
void pack_one_a8(const uint8_t* q, const uint8_t* s, const uint8_t* m, const QHeader& h, uint8_t* out) {
  std::memcpy(out, &h, sizeof h);
  const int64_t sb = h.scale_bytes, groups = h.in / h.group, nkb = h.in / kActBlock, per_group = h.group / kActBlock;
  const int64_t qcols = h.bits == 8 ? h.in : h.in / 2;
  const A8Geom geo(h);
  at::parallel_for(0, h.blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint8_t* block = out + sizeof(QHeader) + b * h.block_bytes;
      for (int64_t o = 0; o < kBlock; ++o) {
        const int64_t row = b * kBlock + o;
        if (row >= h.out) break;
        for (int64_t g = 0; g < groups; ++g) {
          uint8_t* at = block + geo.scales_at(g, sb) + o * sb;
          std::memcpy(at, s + (row * groups + g) * sb, sb);
          if (m != nullptr) std::memcpy(at + geo.mins, m + (row * groups + g) * sb, sb);
        }
        const uint8_t* src = q + row * qcols;
        for (int64_t kb = 0; kb < nkb; ++kb) {
          uint8_t* dst = block + geo.weights_at(kb / per_group, kb, per_group) + o * 4;
          if (h.bits == 8) {
            for (int64_t f = 0; f < kActBlock; ++f) dst[f / 4 * 64 + f % 4] = src[kb * kActBlock + f] ^ 0x80;  // + 128
          } else {
            const uint8_t* pairs = src + kb * kActBlock / 2;  // feature 2i low nibble, 2i + 1 high
            auto nibble = [&](int64_t f) { return f % 2 ? pairs[f / 2] >> 4 : pairs[f / 2] & 15; };
            for (int64_t f = 0; f < 16; ++f) dst[f / 4 * 64 + f % 4] = nibble(f) | nibble(16 + f) << 4;
          }
        }
      }
    }
  });
}

// Rows `ids` of an int8-activation blob (a tied table whose head runs on it), dequantized as
// helios.core.quant.dequantize does: float(q) * scale, then + minimum (int4), in fp32 with no fused
// multiply-add (this file is compiled with -ffp-contract=off), rounded to `dtype`. The layout is
// linear_qa.h's; helios.engine.quantized._a8_rows reads the same bytes with torch ops. `width`, the
// table's row size, is the blob's own (checked): it gives a compiled step the output's shape.
at::Tensor qembedding_a8(const at::Tensor& packed, const at::Tensor& ids, at::ScalarType dtype, int64_t width) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() >= static_cast<int64_t>(sizeof(QHeader)),
              "qembedding_a8: needs one weight's pack_qlinear blob");
  const QHeader h = read_header(packed.data_ptr());
  TORCH_CHECK(is_a8(h.magic) && (h.bits == 4 || h.bits == 8) &&
                  packed.numel() >= static_cast<int64_t>(sizeof h) + h.blocks * h.block_bytes,
              "qembedding_a8: not an int8-activation pack_qlinear blob (act_bits=8)");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "qembedding_a8: rows come as float32, bfloat16 or float16");
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  TORCH_CHECK(width == h.in, "qembedding_a8: the table's rows are ", h.in, " wide, not ", width);
  const int64_t n = flat.numel(), groups = h.in / h.group, sb = h.scale_bytes, per_group = h.group / kActBlock;
  const A8Geom geo(h);
  const int64_t* idp = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < h.out, "qembedding_a8: row ", idp[i], " outside the table's ", h.out, " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(width);
  at::Tensor out = at::empty(shape, packed.options().dtype(dtype));
  const uint8_t* body = static_cast<const uint8_t*>(packed.data_ptr()) + sizeof h;
  auto scale_at = [&](const uint8_t* p) {  // the blob is 4-byte aligned, so are its scales
    if (h.scale_type == kScaleF16) return load(reinterpret_cast<const at::Half*>(p), 0);
    if (h.scale_type == kScaleBF16) return load(reinterpret_cast<const at::BFloat16*>(p), 0);
    return load(reinterpret_cast<const float*>(p), 0);
  };
  auto fill = [&](auto* y) {
    at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t id = idp[i], lane = id % kBlock;
        const uint8_t* block = body + (id / kBlock) * h.block_bytes;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* at = block + geo.scales_at(g, sb) + lane * sb;
          const float s = scale_at(at);
          const float m = h.bits == 4 ? scale_at(at + geo.mins) : 0.0f;
          for (int64_t f = g * h.group; f < (g + 1) * h.group; ++f) {
            const int64_t kb = f / kActBlock, j = f % kActBlock;
            const uint8_t* steps = block + geo.weights_at(g, kb, per_group) + lane * 4;
            int q;
            if (h.bits == 8) {  // step j / 4, byte j % 4: the weight + 128
              q = static_cast<int>(steps[(j / 4) * 64 + j % 4]) - 128;
            } else {  // features 0..15 of the block in low nibbles, 16..31 in high ones
              const int64_t t = j % 16;
              const uint8_t byte = steps[(t / 4) * 64 + t % 4];
              q = j < 16 ? byte & 15 : byte >> 4;
            }
            float v = static_cast<float>(q) * s;
            if (h.bits == 4) v = v + m;
            store(y, i * width + f, v);
          }
        }
      }
    });
  };
  if (dtype == at::kFloat) {
    fill(out.data_ptr<float>());
  } else if (dtype == at::kBFloat16) {
    fill(out.data_ptr<at::BFloat16>());
  } else {
    fill(out.data_ptr<at::Half>());
  }
  return out;
}

at::Tensor qembedding_a8_meta(const at::Tensor& packed, const at::Tensor& ids, at::ScalarType dtype, int64_t width) {
  std::vector<c10::SymInt> shape(ids.sym_sizes().begin(), ids.sym_sizes().end());
  shape.push_back(c10::SymInt(width));
  return at::empty_symint(shape, packed.options().dtype(dtype));
}

}  // namespace flare_native

TORCH_LIBRARY_FRAGMENT(flare_native, m) {
  m.def("qembedding_a8(Tensor packed, Tensor ids, ScalarType dtype, int width) -> Tensor");
}

TORCH_LIBRARY_IMPL(flare_native, CPU, m) { m.impl("qembedding_a8", &flare_native::qembedding_a8); }
TORCH_LIBRARY_IMPL(flare_native, Meta, m) { m.impl("qembedding_a8", &flare_native::qembedding_a8_meta); }
