// pack_linear: the packed weight layouts helios' native linears read. For each block of 16
// outputs, each pair of input features holds the 16 outputs' two weights side by side:
//   w [N, K] bfloat16 -> [ceil(N / 16), ceil(K / 2), 16, 2], outputs past N and a last odd feature zero.
// fp32 weights (read only by the AVX2 kernel, which loads them as they are) keep the pair's two
// features apart instead, 16 outputs each:
//   w [N, K] float32 -> [ceil(N / 16), ceil(K / 2), 2, 16].
// AVX512-BF16's pair dot product reads a block's pair as one 512-bit row; AMX reads 16 pairs as a B
// tile; AVX2 reads 8 outputs' pairs as one 256-bit load and widens the low and high halves of each
// 32-bit lane to fp32 with a shift and a mask (linear_avx2.cpp). So one copy of the weights serves
// every kernel helios may choose.
#include "common.h"

namespace flare_native {

at::Tensor pack_linear(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "pack_linear: needs a 2-D bfloat16 or float32 weight");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t padded_n = (n + kBlock - 1) / kBlock * kBlock, padded_k = (k + 1) / 2 * 2;
  at::Tensor full = w.contiguous();
  if (padded_n != n || padded_k != k) full = at::constant_pad_nd(full, {0, padded_k - k, 0, padded_n - n}, 0);
  const auto blocks = full.view({padded_n / kBlock, kBlock, padded_k / 2, 2});
  return (w.scalar_type() == at::kFloat ? blocks.permute({0, 2, 3, 1}) : blocks.permute({0, 2, 1, 3})).contiguous();
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = c10::SymInt(out_features);
  return at::empty_symint(shape, x.options());
}

LinearCall linear_call(const char* name, const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t out_features, bool float_weights) {
  const bool f32 = packed.scalar_type() == at::kFloat;
  TORCH_CHECK(!f32 || float_weights, name, ": needs bfloat16 weights (float32 ones run on linear_avx2)");
  TORCH_CHECK((packed.scalar_type() == at::kBFloat16 || f32) && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == (f32 ? 2 : kBlock) && packed.size(3) == (f32 ? kBlock : 2),
              name, ": needs a pack_linear weight");
  const int64_t k = x.size(-1);
  TORCH_CHECK(k > 0 && (k + 1) / 2 == packed.size(1), name, ": input size ", k, " does not match the weight's ",
              packed.size(1) * 2);
  TORCH_CHECK(out_features > 0 && out_features <= packed.size(0) * kBlock &&
                  out_features > (packed.size(0) - 1) * kBlock,
              name, ": out_features out of range");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  LinearCall call{at::empty(shape, x.options()), x.numel() / k, at::Tensor()};
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features, name, ": bias size");
    call.bias = bias->to(at::kFloat).contiguous();
  }
  return call;
}

}  // namespace flare_native
