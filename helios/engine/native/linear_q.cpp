// pack_qlinear and qlinear (linear_q.h): the blob, the op, and its AVX-512 kernel (16 outputs per
// zmm register; linear_q_kernel.h holds the kernels both instruction sets share).
#include "linear_q.h"
#include "linear_qa.h"

#include <torch/library.h>

#include <cstdlib>
#include <string>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace flare_native {
namespace {

#if defined(__AVX512F__)
#define QK_TARGET
struct Avx512 {
  using F = __m512;
  static constexpr int kFewRows = 4, kFewBlocks = 4, kTile = 4, kRows = 6, kMicroBlocks = 4;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F bcast(const float* p) { return _mm512_set1_ps(*p); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F scales(const uint8_t* p, int type) { return scales_avx512(p, type); }
  static F i8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void u4(const uint8_t* p, F& lo, F& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
};
#include "linear_q_kernel.h"
#endif

enum class Isa { kNone, kAvx2, kAvx512 };

// FLARE_QLINEAR_ISA=avx2|avx512 picks the kernel for tests and benchmarks; otherwise the widest
// this build and CPU run (both give the same bits: linear_q.h).
Isa chosen() {
  const char* forced = std::getenv("FLARE_QLINEAR_ISA");
  if (forced != nullptr && *forced != '\0') {
    const std::string name(forced);
    if (name == "avx512") {
      TORCH_CHECK(has_qlinear_avx512(), "qlinear: FLARE_QLINEAR_ISA=avx512 but this build or CPU has no AVX-512");
      return Isa::kAvx512;
    }
    if (name == "avx2") {
      TORCH_CHECK(has_qlinear_avx2(), "qlinear: FLARE_QLINEAR_ISA=avx2 but this CPU has no AVX2 and FMA");
      return Isa::kAvx2;
    }
    TORCH_CHECK(false, "qlinear: FLARE_QLINEAR_ISA must be avx2 or avx512 (or unset), not ", name);
  }
  if (has_qlinear_avx512()) return Isa::kAvx512;
  if (has_qlinear_avx2()) return Isa::kAvx2;
  return Isa::kNone;
}

// stored [.., out, cols] -> the blob bytes of one weight (2-D slices of a stack packed in turn).
void pack_one(const uint8_t* q, const uint8_t* s, const uint8_t* m, const QHeader& h, uint8_t* out) {
  std::memcpy(out, &h, sizeof h);
  const int64_t sb = h.scale_bytes, groups = h.in / h.group, gb = h.bits == 8 ? h.group : h.group / 2;
  const int64_t qcols = h.bits == 8 ? h.in : h.in / 2, head = kBlock * sb * (h.bits == 4 ? 2 : 1);
  at::parallel_for(0, h.blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint8_t* block = out + sizeof(QHeader) + b * h.block_bytes;
      std::memset(block, 0, h.block_bytes);
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* gp = block + g * (head + gb * kBlock);
        for (int64_t o = 0; o < kBlock; ++o) {
          const int64_t row = b * kBlock + o;
          if (row >= h.out) break;
          std::memcpy(gp + o * sb, s + (row * groups + g) * sb, sb);
          if (m != nullptr) std::memcpy(gp + (kBlock + o) * sb, m + (row * groups + g) * sb, sb);
          const uint8_t* src = q + row * qcols + g * gb;
          for (int64_t i = 0; i < gb; ++i) gp[head + i * kBlock + o] = src[i];
        }
      }
    }
  });
}

}  // namespace

bool has_qlinear_avx512() {
#if defined(__AVX512F__)
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
#else
  return false;
#endif
}

void qlinear_avx512(const QCall& call) {
#if defined(__AVX512F__)
  QKernel<Avx512>::run(call);
#else
  TORCH_CHECK(false, "qlinear: this build has no AVX-512 kernel");
#endif
}

bool has_qlinear() { return has_qlinear_avx512() || has_qlinear_avx2(); }

at::Tensor pack_qlinear(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                        int64_t group, int64_t act_bits) {
  TORCH_CHECK(act_bits == 32 || act_bits == 8,
              "pack_qlinear: act_bits must be 32 (float activations, exact) or 8 (int8 activations, linear_qa.h)");
  const bool int4 = mins.has_value() && mins->defined();
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "pack_qlinear: group must be 32, 64 or 128, not ", group);
  TORCH_CHECK(qweight.dim() >= 2, "pack_qlinear: needs a quantized weight [..., out, in] (helios.core.quant)");
  TORCH_CHECK(qweight.scalar_type() == (int4 ? at::kByte : at::kChar),
              "pack_qlinear: int8 weights are int8 (no mins), int4 weights uint8 with two values per byte (with mins)");
  const at::ScalarType stype = scales.scalar_type();
  TORCH_CHECK(stype == at::kFloat || stype == at::kBFloat16 || stype == at::kHalf,
              "pack_qlinear: scales must be float32, bfloat16 or float16");
  const int64_t out = qweight.size(-2), in = qweight.size(-1) * (int4 ? 2 : 1);
  TORCH_CHECK(in > 0 && out > 0 && in % group == 0, "pack_qlinear: the input size ", in,
              " is not a positive multiple of the group ", group);
  std::vector<int64_t> lead(qweight.sizes().begin(), qweight.sizes().end() - 2), sshape = lead;
  sshape.push_back(out);
  sshape.push_back(in / group);
  TORCH_CHECK(scales.sizes() == at::IntArrayRef(sshape), "pack_qlinear: scales must be ", at::IntArrayRef(sshape),
              " for this weight, not ", scales.sizes());
  if (int4)
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->scalar_type() == scales.scalar_type(),
                "pack_qlinear: mins must match the scales' shape and dtype");
  const bool a8 = act_bits == 8;
  const int32_t type = stype == at::kHalf ? kScaleF16 : stype == at::kBFloat16 ? kScaleBF16 : kScaleF32;
  QHeader h{a8 ? kQMagicA8L : kQMagic, int4 ? 4 : 8, group, in, out, (out + kBlock - 1) / kBlock,
            static_cast<int32_t>(scales.element_size()), type, 0};
  const int64_t per_group = kBlock * h.scale_bytes * (int4 ? 2 : 1) + (int4 ? group / 2 : group) * kBlock;
  h.block_bytes = a8 ? A8Geom(h).block_bytes(in / group) : in / group * per_group;
  // Each weight's blob a multiple of 64 bytes, so that every expert of a stack starts on a cache line.
  const int64_t bytes = (static_cast<int64_t>(sizeof(QHeader)) + h.blocks * h.block_bytes + 63) / 64 * 64;
  int64_t count = 1;
  for (int64_t d : lead) count *= d;
  const at::Tensor q = qweight.contiguous(), s = scales.contiguous();
  const at::Tensor m = int4 ? mins->contiguous() : at::Tensor();
  at::Tensor blob = at::zeros({count, bytes}, at::kByte);
  const int64_t qstride = out * q.size(-1), sstride = out * (in / group) * h.scale_bytes;
  for (int64_t e = 0; e < count; ++e) {
    const auto* qp = static_cast<const uint8_t*>(q.data_ptr()) + e * qstride;
    const auto* sp = static_cast<const uint8_t*>(s.data_ptr()) + e * sstride;
    const auto* mp = int4 ? static_cast<const uint8_t*>(m.data_ptr()) + e * sstride : nullptr;
    if (a8) {
      pack_one_a8(qp, sp, mp, h, blob.data_ptr<uint8_t>() + e * bytes);
    } else {
      pack_one(qp, sp, mp, h, blob.data_ptr<uint8_t>() + e * bytes);
    }
  }
  if (lead.empty()) return blob.view({bytes});
  lead.push_back(bytes);
  return blob.view(lead);
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                   int64_t out_features) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() >= static_cast<int64_t>(sizeof(QHeader)),
              "qlinear: needs one weight's pack_qlinear blob (a stack's blob[e] for expert e)");
  const QHeader h = read_header(packed.data_ptr());
  const bool a8 = is_a8(h.magic);
  TORCH_CHECK((h.magic == kQMagic || a8) && (h.bits == 4 || h.bits == 8) &&
                  packed.numel() >= static_cast<int64_t>(sizeof h) + h.blocks * h.block_bytes,
              "qlinear: not a pack_qlinear blob of this build (pack the stored weights again)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 4 == 0, "qlinear: the blob must be 4-byte aligned");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "qlinear: needs float32 or bfloat16 activations");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == h.in, "qlinear: input size ", x.size(-1), " does not match the weight's ",
              h.in);
  TORCH_CHECK(out_features == h.out, "qlinear: out_features ", out_features, " but the weight has ", h.out);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = h.out;
  at::Tensor y = at::empty(shape, x.options());
  const int64_t rows = x.numel() / h.in;
  if (rows == 0) return y;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == h.out, "qlinear: bias size ", bias->numel(), " but ", h.out, " outputs");
    b = bias->to(at::kFloat).contiguous();
  }
  // The int8-activation kernels quantize bfloat16 rows where they lie; the float ones take fp32
  // (a copy, exact for bfloat16).
  const bool in_place = a8 && x.scalar_type() == at::kBFloat16;
  const at::Tensor xf = in_place ? x.reshape({rows, h.in}).contiguous() : x.reshape({rows, h.in}).to(at::kFloat).contiguous();
  QCall call{&h, static_cast<const uint8_t*>(packed.data_ptr()) + sizeof h, nullptr, rows, h.in,
             b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr(), x.scalar_type() == at::kBFloat16};
  if (in_place) {
    call.xb = reinterpret_cast<const uint16_t*>(xf.data_ptr());
  } else {
    call.x = xf.data_ptr<float>();
  }
  const Isa isa = chosen();
  if (a8) {  // int8 activations: AVX512-VNNI where present, else AVX2 (the same bits)
    const bool forced = std::getenv("FLARE_QLINEAR_ISA") != nullptr && *std::getenv("FLARE_QLINEAR_ISA") != '\0';
    if (isa == Isa::kAvx512 && has_qlinear_a8_avx512()) {
      qlinear_a8_avx512(call);
    } else {
      TORCH_CHECK(!(forced && isa == Isa::kAvx512),
                  "qlinear: FLARE_QLINEAR_ISA=avx512 but this build or CPU has no AVX512-VNNI for int8 activations");
      TORCH_CHECK(isa != Isa::kNone, "qlinear: this CPU has neither AVX-512 nor AVX2+FMA (check has_qlinear first)");
      qlinear_a8_avx2(call);
    }
    return y;
  }
  switch (isa) {
    case Isa::kAvx512: qlinear_avx512(call); break;
    case Isa::kAvx2: qlinear_avx2(call); break;
    default: TORCH_CHECK(false, "qlinear: this CPU has neither AVX-512 nor AVX2+FMA (check has_qlinear first)");
  }
  return y;
}

at::Tensor qlinear_meta(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        int64_t out_features) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = c10::SymInt(out_features);
  return at::empty_symint(shape, x.options());
}

}  // namespace flare_native

TORCH_LIBRARY_FRAGMENT(flare_native, m) {
  m.def("has_qlinear() -> bool", &flare_native::has_qlinear);
  m.def("has_qlinear_avx512() -> bool", &flare_native::has_qlinear_avx512);
  m.def("has_qlinear_avx2() -> bool", &flare_native::has_qlinear_avx2);
  m.def("pack_qlinear(Tensor qweight, Tensor scales, Tensor? mins, int group, int act_bits=32) -> Tensor");
  m.def("qlinear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(flare_native, CPU, m) {
  m.impl("pack_qlinear", &flare_native::pack_qlinear);
  m.impl("qlinear", &flare_native::qlinear);
}

TORCH_LIBRARY_IMPL(flare_native, Meta, m) { m.impl("qlinear", &flare_native::qlinear_meta); }
