// linear multiplies bfloat16 activations by bfloat16 weights packed once at load (pack_linear) with
// AVX512-BF16's pair dot product: a micro-kernel keeps up to 6 rows x 64 outputs of fp32
// accumulators in registers and streams one 64-output tile of weights per task, so a decode step
// reads every weight once whatever its row count. linear_tiles reads the same packed weights as AMX
// tiles (CPUs with AMX-BF16), which keeps many rows as cheap as few. Built only where the compiler
// targets AVX512-BF16; helios measures both against oneDNN and linear_avx2 before using either.
#include "avx512_bf16.h"

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define FLARE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace flare_native {
namespace {

#if defined(__AVX512BF16__)
template <int NB>
void tile(const uint16_t* x, int64_t rows, int64_t k, const uint16_t* w, int64_t block, int64_t n, const float* bias,
          uint16_t* y) {
  const int64_t pairs = k / 2;
  alignas(64) float buf[6 * NB * kBlock];
  const uint16_t* wt = w + block * pairs * 2 * kBlock;
  for (int64_t m = 0; m < rows;) {
    const int64_t r = std::min<int64_t>(rows - m, 6);
    const uint16_t* xm = x + m * k;
    switch (r) {
      case 6: micro<6, NB>(xm, k, wt, pairs, buf); break;
      case 5: micro<5, NB>(xm, k, wt, pairs, buf); break;
      case 4: micro<4, NB>(xm, k, wt, pairs, buf); break;
      case 3: micro<3, NB>(xm, k, wt, pairs, buf); break;
      case 2: micro<2, NB>(xm, k, wt, pairs, buf); break;
      default: micro<1, NB>(xm, k, wt, pairs, buf); break;
    }
    for (int64_t i = 0; i < r; ++i)
      for (int j = 0; j < NB; ++j) {
        const int64_t first = (block + j) * kBlock;
        if (first >= n) break;
        store_block(buf + (i * NB + j) * kBlock, bias, first, n, y + (m + i) * n);
      }
    m += r;
  }
}
#endif

#if defined(FLARE_AMX)
// AMX: the same packed layout is what TDPBF16PS reads as its B tile (16 pairs of input features x
// 16 outputs x 2 = 16 rows of 64 bytes), so the tile path needs no second copy of the weights. Each
// task owns 32 outputs (two packed blocks) and walks every 32-row slice of the input through them,
// so the task's weights stay in L2 while the rows stream past.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {  // Linux hands out the tile state only on request, once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// Every tile is 64 bytes wide; the result and input tiles have `rows` rows (fewer than 16 only
// when the whole input has fewer rows: then nothing is padded), the weight tiles 16.
void amx_configure(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t < 6 ? rows : 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// tmm0-3: fp32 results (row slice i, block j) at 2i + j; tmm4-5: input rows; tmm6-7: weights.
template <int MB, int NB>
void amx_slice(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t stride, int64_t steps, float* out) {
  _tile_zero(0);
  if (NB == 2) _tile_zero(1);
  if (MB == 2) _tile_zero(2);
  if (MB == 2 && NB == 2) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* ws = w + s * 16 * 2 * kBlock;
    // The weights stream from memory once per step (at few rows this is all the time there is):
    // fetch the tiles four steps ahead.
    for (int line = 0; line < 16; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(ws + 4 * 16 * 2 * kBlock) + 64 * line, _MM_HINT_T0);
      if (NB == 2) _mm_prefetch(reinterpret_cast<const char*>(ws + stride + 4 * 16 * 2 * kBlock) + 64 * line, _MM_HINT_T0);
    }
    _tile_loadd(6, ws, 64);
    if (NB == 2) _tile_loadd(7, ws + stride, 64);
    _tile_loadd(4, x + s * 32, ldx * 2);
    if (MB == 2) _tile_loadd(5, x + 16 * ldx + s * 32, ldx * 2);
    _tile_dpbf16ps(0, 4, 6);
    if (NB == 2) _tile_dpbf16ps(1, 4, 7);
    if (MB == 2) _tile_dpbf16ps(2, 5, 6);
    if (MB == 2 && NB == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  if (NB == 2) _tile_stored(1, out + 256, 64);
  if (MB == 2) _tile_stored(2, out + 512, 64);
  if (MB == 2 && NB == 2) _tile_stored(3, out + 768, 64);
}

// x [padded_rows, k] with k a multiple of 32 and padded_rows either a multiple of 16 or rows itself
// when rows < 16; writes the first `rows` rows.
void amx_linear(const uint16_t* x, int64_t rows, int64_t padded_rows, int64_t k, const uint16_t* w, int64_t blocks,
                int64_t n, const float* bias, uint16_t* y) {
  const int64_t stride = k * kBlock, steps = k / 32, groups = (blocks + 1) / 2;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    amx_configure(static_cast<int>(std::min<int64_t>(padded_rows, 16)));
    alignas(64) float buf[4 * 256];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t block = 2 * g, nb = std::min<int64_t>(2, blocks - block);
      const uint16_t* wg = w + block * stride;
      for (int64_t m = 0; m < padded_rows; m += 32) {
        const int64_t mb = padded_rows < 16 ? 1 : std::min<int64_t>(2, (padded_rows - m) / 16);
        const uint16_t* xm = x + m * k;
        if (mb == 2 && nb == 2) amx_slice<2, 2>(xm, k, wg, stride, steps, buf);
        else if (mb == 2) amx_slice<2, 1>(xm, k, wg, stride, steps, buf);
        else if (nb == 2) amx_slice<1, 2>(xm, k, wg, stride, steps, buf);
        else amx_slice<1, 1>(xm, k, wg, stride, steps, buf);
        for (int64_t i = 0; i < mb; ++i)
          for (int64_t r = 0; r < 16 && m + 16 * i + r < rows; ++r)
            for (int64_t j = 0; j < nb; ++j) {
              const int64_t first = (block + j) * kBlock;
              if (first >= n) break;
              store_block(buf + (2 * i + j) * 256 + r * 16, bias, first, n, y + (m + 16 * i + r) * n);
            }
      }
    }
    _tile_release();
  });
}
#endif

}  // namespace

bool has_bf16_linear() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool has_amx_linear() {
#if defined(FLARE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

// amx: run on AMX tiles where the CPU has them and the input size is a multiple of 32. The two
// paths may differ in the last bit of a product, so a program uses one of them for every row count
// (linear or linear_tiles), and a row's result never depends on how many rows share its step.
namespace {

at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features, bool amx) {
  TORCH_CHECK(x.size(-1) % 2 == 0, "linear: the input size must be even (linear_avx2 takes odd sizes)");
  LinearCall call = linear_call("linear", x, packed, bias, out_features);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear: needs bfloat16 activations");
  at::Tensor y = call.out;
  const int64_t rows = call.rows, k = x.size(-1);
  if (rows == 0) return y;
  const at::Tensor& bias_f = call.bias;
#if defined(__AVX512BF16__)
  at::Tensor xc = x.contiguous();
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t blocks = packed.size(0), tiles = (blocks + 3) / 4;
#if defined(FLARE_AMX)
  if (amx && k % 32 == 0 && amx_permitted()) {
    const int64_t padded = rows < 16 ? rows : (rows + 15) / 16 * 16;
    if (padded != rows) xc = at::cat({xc.view({rows, k}), at::zeros({padded - rows, k}, xc.options())});
    amx_linear(reinterpret_cast<const uint16_t*>(xc.data_ptr()), rows, padded, k, wp, blocks, out_features, bp, yp);
    return y;
  }
#endif
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t block = t * 4, count = std::min<int64_t>(4, blocks - block);
      if (count == 4) {
        tile<4>(xp, rows, k, wp, block, out_features, bp, yp);
      } else {
        for (int64_t j = 0; j < count; ++j) tile<1>(xp, rows, k, wp, block + j, out_features, bp, yp);
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "linear: this build has no AVX512-BF16 kernel");
#endif
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out_features) {
  return linear_impl(x, packed, bias, out_features, false);
}

at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        int64_t out_features) {
  return linear_impl(x, packed, bias, out_features, true);
}

}  // namespace flare_native
