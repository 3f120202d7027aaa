// linear_avx2: bfloat16 or fp32 weights (pack_linear's layouts) times bfloat16 or fp32 activations on
// AVX2+FMA, the instruction set of most CPUs people own (AMD Zen 1-3, Intel client cores without
// AVX-512). An fp32 core's weights take the same loops, loaded instead of widened (F32Weights).
//
// The weights stay bfloat16 in memory, so a decode step streams half the bytes of an fp32 core. One
// 256-bit load holds 8 outputs' weights for a pair of input features (each 32-bit lane: the even
// feature's bfloat16 in the low half, the odd one's in the high half); a shift left by 16 makes the
// even weights fp32 and a mask of the high halves the odd ones, exactly (bfloat16 is the top half
// of an fp32). Activations are widened to fp32 once per call. Products are fused multiply-adds in
// fp32, and outputs (+ bias) are rounded to bfloat16 nearest-even, as torch's cast does.
//
// Register blocking: one decode row takes 8 blocks of 16 outputs at once, two rows 4 (weight streams
// in flight: memory, not arithmetic, limits them); fp32 weights at 3-6 rows take 2 blocks at once in
// row groups of up to 4 (few); otherwise 3 rows and more go block by block in groups of
// up to 6 rows (12 accumulators: each weight is loaded and widened once per 6 rows, and each
// accumulator's chain of FMAs has room to hide their latency), in panels of 48 rows whose inputs
// stay in cache while the thread's blocks stream past (a prompt chunk reads the weights once per
// panel, not its inputs once per block), each block's features in slices that stay in the level-1
// cache while every group of the panel goes through them (blocks). Threads take runs of output
// blocks in turn (common.h: parallel_runs) and never split a reduction, and every output is accumulated in the same order
// (features ascending, the pair's even then odd product) whatever rows share the call, so a row's
// bits never depend on its neighbours.
//
// The functions carry target("avx2,fma"), so they exist in every x86-64 build of the library (an
// AVX-512 host included, where its tests run); has_avx2_linear asks the CPU at run time. This file
// is compiled without AVX-512 (native/__init__.py) so that what runs here is what an AVX2 host runs.
#include <type_traits>

#include "avx2.h"

namespace flare_native {
namespace {

#if defined(FLARE_X86)
constexpr int64_t kHalf = 8;     // outputs per 256-bit register
constexpr int64_t kAhead = 32;   // feature pairs (64-byte lines of a block) fetched ahead of use
constexpr int kRows = 6;         // rows per register block from 3 rows (micro1)
constexpr int64_t kPanel = 48;   // most rows whose inputs stay in cache while a thread's blocks stream past
// A block's weights per slice of its features (blocks): a quarter of the smallest x86-64 level-1
// data cache (32 KiB), leaving room for the group's inputs. 8 and 16 KiB measured alike on a Zen 3
// (both 1.4-1.6x whole blocks at 16-64 rows); whole blocks of 1,536 inputs spilled to level 2.
constexpr int64_t kSliceBytes = 8192;
// Blocks wide() takes at once for one and two rows: 8 weight streams for one row; 4 for two, whose
// 16 accumulators already fill the registers (8 blocks spilled them: two rows took 1.3x one row's
// time on a Zen 3, 1.0x with 4).
constexpr int64_t kWideBlocks[] = {0, 8, 4};

// The two weight layouts (linear_pack.cpp), read a feature pair at a time: a block's pair p starts
// 2 * kBlock elements past pair p - 1 in both, and yields the 16 outputs' even-feature weights
// (e0: outputs 0-7, e1: 8-15) and odd-feature weights (o0, o1) as fp32.
//   bfloat16 [pairs, 16, 2]: each 32-bit lane holds one output's even weight in its low half and its
//   odd weight in its high half; a shift left by 16 makes the even ones fp32, a mask of the high
//   halves the odd ones, exactly (one vpand each, its constant read from memory where the registers
//   are full: two shifts in its place ran 2-10 % slower at 64-512 rows on a Zen 3).
//   fp32 [pairs, 2, 16]: the even feature's 16 weights, then the odd one's, loaded as they are.
struct Bf16Weights {
  using T = uint16_t;
  struct Pair {
    __m256i lo, hi;
  };
  FLARE_AVX2 static inline Pair load(const T* wp) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + kBlock))};
  }
  FLARE_AVX2 static inline void even(const Pair& w, __m256& e0, __m256& e1) {
    e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w.lo, 16));
    e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w.hi, 16));
  }
  FLARE_AVX2 static inline void odd(const Pair& w, __m256& o0, __m256& o1) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    o0 = _mm256_castsi256_ps(_mm256_and_si256(w.lo, high));
    o1 = _mm256_castsi256_ps(_mm256_and_si256(w.hi, high));
  }
};

struct F32Weights {
  using T = float;
  struct Pair {
    const float* p;
  };
  FLARE_AVX2 static inline Pair load(const T* wp) { return {wp}; }
  FLARE_AVX2 static inline void even(const Pair& w, __m256& e0, __m256& e1) {
    e0 = _mm256_loadu_ps(w.p);
    e1 = _mm256_loadu_ps(w.p + kHalf);
  }
  FLARE_AVX2 static inline void odd(const Pair& w, __m256& o0, __m256& o1) {
    o0 = _mm256_loadu_ps(w.p + kBlock);
    o1 = _mm256_loadu_ps(w.p + kBlock + kHalf);
  }
};

// rows [m, m + MR) x blocks [0, NB) of a task: acc[(r * NB + j) * 16 + o] = sum_p w[p] x[r][p] for
// output o of block j. w points at the first block (blocks `stride` elements apart), x at row m.
template <typename W, int MR, int NB>
FLARE_AVX2 inline void micro(const float* x, int64_t ldx, const typename W::T* w, int64_t stride, int64_t pairs,
                             float* acc_out) {
  __m256 acc[MR][2 * NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 2 * NB; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    for (int j = 0; j < NB; ++j) {
      const typename W::Pair pair = W::load(w + j * stride + p * 2 * kBlock);
      __m256 even0, even1, odd0, odd1;
      W::even(pair, even0, even1);
      W::odd(pair, odd0, odd1);
      for (int r = 0; r < MR; ++r) {
        const __m256 a = _mm256_broadcast_ss(x + r * ldx + 2 * p);
        const __m256 b = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
        acc[r][2 * j] = _mm256_fmadd_ps(b, odd0, _mm256_fmadd_ps(a, even0, acc[r][2 * j]));
        acc[r][2 * j + 1] = _mm256_fmadd_ps(b, odd1, _mm256_fmadd_ps(a, even1, acc[r][2 * j + 1]));
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 2 * NB; ++j) _mm256_storeu_ps(acc_out + (r * NB * 2 + j) * kHalf, acc[r][j]);
}

// One feature pair of one block into MR rows' accumulators acc[r][j], acc[r][j + 1] (x: the pair's
// even input of row 0): the even weights feed every row before the odd ones are made, so the
// block's two weight registers and a broadcast are all it needs beside the accumulators.
template <typename W, int MR, int S>
FLARE_AVX2 __attribute__((always_inline)) inline void pair_into(const float* x, int64_t ldx, const typename W::T* wp,
                                                                  __m256 (&acc)[MR][S], int j) {
  // fp32 weights: the empty asm keeps each loaded weight in its register. Left alone, GCC folded
  // the load into every row's multiply-add (vfmadd231ps mem): 24 256-bit loads a feature pair at 6
  // rows where 4 do, so the load ports, not the multiply-adds, set the pace (fp32 weights at 512
  // rows ran at 0.7x bfloat16's FLOP/s on a Zen 3; 1.0-1.1x with the weights in registers).
  constexpr bool pin = std::is_same_v<W, F32Weights>;
  const typename W::Pair pair = W::load(wp);
  __m256 w0, w1;
  W::even(pair, w0, w1);
  if constexpr (pin) __asm__("" : "+x"(w0), "+x"(w1));
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m256 a = _mm256_broadcast_ss(x + r * ldx);
    acc[r][j] = _mm256_fmadd_ps(a, w0, acc[r][j]);
    acc[r][j + 1] = _mm256_fmadd_ps(a, w1, acc[r][j + 1]);
  }
  W::odd(pair, w0, w1);
  if constexpr (pin) __asm__("" : "+x"(w0), "+x"(w1));
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m256 b = _mm256_broadcast_ss(x + r * ldx + 1);
    acc[r][j] = _mm256_fmadd_ps(b, w0, acc[r][j]);
    acc[r][j + 1] = _mm256_fmadd_ps(b, w1, acc[r][j + 1]);
  }
}

// micro<MR, 1> for up to 6 rows: each pair's even weights feed every row before its odd ones are
// made (the same products in the same order per output as micro), so 12 accumulators, two weight
// registers and a broadcast fit the 16 registers. The row loops are unrolled by pragma: left to
// -O3's heuristics, the accumulators went through the stack every pair.
// `resume`: the sums go on from acc_out's (the same chain of fused multiply-adds, so a block's
// features taken in several calls give the bits of one call).
template <typename W, int MR>
FLARE_AVX2 inline void micro1(const float* x, int64_t ldx, const typename W::T* w, int64_t pairs, float* acc_out,
                              bool resume) {
  __m256 acc[MR][2];
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = resume ? _mm256_loadu_ps(acc_out + r * kBlock) : _mm256_setzero_ps();
    acc[r][1] = resume ? _mm256_loadu_ps(acc_out + r * kBlock + kHalf) : _mm256_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const typename W::T* wp = w + p * 2 * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead * 2 * kBlock), _MM_HINT_T0);
    pair_into<W>(x + 2 * p, ldx, wp, acc, 0);
  }
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(acc_out + r * kBlock, acc[r][0]);
    _mm256_storeu_ps(acc_out + r * kBlock + kHalf, acc[r][1]);
  }
}

// 8 fp32 -> 8 bfloat16, nearest even (NaN -> 0x7FC0), as c10::BFloat16's conversion.
FLARE_AVX2 inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}

// One row's 16 results of the block starting at output `first` (+ bias) into y[first:], past n masked.
template <typename Y>
FLARE_AVX2 inline void store_block(const float* acc, const float* bias, int64_t first, int64_t n, Y* y) {
  const int64_t count = std::min<int64_t>(kBlock, n - first);
  alignas(32) float sum[kBlock];
  for (int h = 0; h < 2; ++h) {
    __m256 v = _mm256_loadu_ps(acc + h * kHalf);
    if (bias != nullptr) {
      alignas(32) float b[kHalf] = {};
      for (int64_t o = h * kHalf; o < std::min<int64_t>(count, (h + 1) * kHalf); ++o) b[o - h * kHalf] = bias[first + o];
      v = _mm256_add_ps(v, _mm256_load_ps(b));
    }
    if constexpr (std::is_same_v<Y, uint16_t>) {
      alignas(16) uint16_t out[kHalf];
      _mm_store_si128(reinterpret_cast<__m128i*>(out), to_bf16(v));
      if (count >= (h + 1) * kHalf) {
        std::memcpy(y + first + h * kHalf, out, sizeof out);
      } else {
        for (int64_t o = h * kHalf; o < count; ++o) y[first + o] = out[o - h * kHalf];
      }
    } else {
      _mm256_store_ps(sum + h * kHalf, v);
    }
  }
  if constexpr (!std::is_same_v<Y, uint16_t>) std::memcpy(y + first, sum, count * sizeof(float));
}

// MR rows through blocks [b0, b1), kWideBlocks[MR] blocks at a time (the last groups 4, 2, 1):
// several weight streams in flight (measured on a busy 2-core EPYC, one thread: a decode row's linears 0.8x the
// time of four streams with prefetches; software prefetches only cost issue slots here).
template <typename W, int MR, typename Y>
FLARE_AVX2 void wide(const float* x, int64_t ldx, const typename W::T* w, int64_t stride, int64_t pairs, int64_t b0,
                     int64_t b1, int64_t n, const float* bias, Y* y) {
  alignas(32) float acc[MR * 8 * kBlock];
  constexpr int64_t most = kWideBlocks[MR];
  for (int64_t b = b0, count; b < b1; b += count) {
    const int64_t left = b1 - b;
    count = left >= most ? most : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    const typename W::T* wb = w + b * stride;
    switch (count) {
      case 8: if constexpr (most == 8) micro<W, MR, 8>(x, ldx, wb, stride, pairs, acc); break;
      case 4: if constexpr (most >= 4) micro<W, MR, 4>(x, ldx, wb, stride, pairs, acc); break;
      case 2: micro<W, MR, 2>(x, ldx, wb, stride, pairs, acc); break;
      default: micro<W, MR, 1>(x, ldx, wb, stride, pairs, acc); break;
    }
    for (int64_t r = 0; r < MR; ++r)
      for (int64_t j = 0; j < count; ++j)
        store_block(acc + (r * count + j) * kBlock, bias, (b + j) * kBlock, n, y + r * n);
  }
}

// micro1's order for NB blocks at once (few): per pair and block, the even weights feed every row,
// then the odd ones; MR x NB x 2 accumulators, two weight registers and a broadcast.
template <typename W, int MR, int NB>
FLARE_AVX2 inline void micro_n(const float* x, int64_t ldx, const typename W::T* w, int64_t stride, int64_t pairs,
                               float* acc_out) {
  __m256 acc[MR][2 * NB];
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 8
    for (int j = 0; j < 2 * NB; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    #pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) pair_into<W>(x + 2 * p, ldx, w + j * stride + p * 2 * kBlock, acc, 2 * j);
  }
  #pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
    #pragma GCC unroll 8
    for (int j = 0; j < 2 * NB; ++j) _mm256_storeu_ps(acc_out + (r * NB * 2 + j) * kHalf, acc[r][j]);
}

// fp32 weights at 3 to 6 rows (few_rows): two blocks at a time (two weight streams in flight, where
// the panels below stream one), the rows in even groups of up to 3 or 4 (micro_n): the first group
// reads the two blocks from memory, the next from cache. Measured on a Zen 3, two threads, SmolLM2's
// linears: 1.2-1.5x the panels' speed at 3-6 rows; bfloat16 weights, whose widening is paid per row
// group, ran slower this way than in panels and keep them.
template <typename W>
constexpr bool few_rows(int64_t rows) {
  return std::is_same_v<W, F32Weights> && rows >= 3 && rows <= 6;
}

template <typename W, typename Y>
FLARE_AVX2 void few(const float* x, int64_t rows, int64_t ldx, const typename W::T* w, int64_t stride, int64_t pairs,
                    int64_t b0, int64_t b1, int64_t n, const float* bias, Y* y) {
  alignas(32) float acc[4 * 2 * kBlock];
  const int64_t groups = (rows + 3) / 4;
  for (int64_t b = b0, count; b < b1; b += count) {
    count = b1 - b >= 2 ? 2 : 1;
    const typename W::T* wb = w + b * stride;
    for (int64_t g = 0, m = 0; g < groups; ++g) {
      const int r = static_cast<int>(rows / groups + (g < rows % groups ? 1 : 0));
      const float* xm = x + m * ldx;
      const auto with = [&](auto nb) {  // 3-6 rows split evenly: groups of 2, 3 or 4 rows
        constexpr int NB = decltype(nb)::value;
        switch (r) {
          case 4: micro_n<W, 4, NB>(xm, ldx, wb, stride, pairs, acc); break;
          case 3: micro_n<W, 3, NB>(xm, ldx, wb, stride, pairs, acc); break;
          default: micro_n<W, 2, NB>(xm, ldx, wb, stride, pairs, acc); break;
        }
      };
      if (count == 2) with(std::integral_constant<int, 2>{});
      else with(std::integral_constant<int, 1>{});
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < count; ++j)
          store_block(acc + (i * count + j) * kBlock, bias, (b + j) * kBlock, n, y + (m + i) * n);
      m += r;
    }
  }
}

// Every row through blocks [b0, b1). One or two decode rows take 8 or 4 blocks at once (several
// weight streams in flight), fp32 weights at 3-6 rows two (few); more rows go block by block in
// groups of up to 6 rows, panel by panel, so a block's weights come from memory for its first rows
// and from cache for the rest of the panel.
// A block's features go in slices of about kSliceBytes of weights, every group of the panel
// through one slice before the next: the slice stays in the level-1 cache for all of them (a
// whole block of a 1,536-input fp32 weight is 96 KiB), and each group's sums go on from where the
// previous slice left them, in the same order (micro1's `resume`).
template <typename W, typename Y>
FLARE_AVX2 void blocks(const float* x, int64_t rows, int64_t ldx, const typename W::T* w, int64_t pairs, int64_t b0,
                       int64_t b1, int64_t n, const float* bias, Y* y) {
  const int64_t stride = pairs * 2 * kBlock;  // elements per packed block
  if (rows == 1) return wide<W, 1>(x, ldx, w, stride, pairs, b0, b1, n, bias, y);
  if (rows == 2) return wide<W, 2>(x, ldx, w, stride, pairs, b0, b1, n, bias, y);
  if (few_rows<W>(rows)) return few<W>(x, rows, ldx, w, stride, pairs, b0, b1, n, bias, y);
  const int64_t most = std::max<int64_t>(1, kSliceBytes / static_cast<int64_t>(2 * kBlock * sizeof(typename W::T)));
  const int64_t slices = (pairs + most - 1) / most;
  alignas(32) float acc[kPanel * kBlock];
  // Panels as even as they go (64 rows as 32 + 32, not 48 + 16: a thin last panel streams every
  // weight once more for few rows; fp32 weights at 56-64 rows ran 1.1-1.2x faster so on a Zen 3).
  const int64_t panels = (rows + kPanel - 1) / kPanel, panel = (rows + panels - 1) / panels;
  for (int64_t p0 = 0; p0 < rows; p0 += panel) {
    const int64_t p1 = std::min(rows, p0 + panel);
    const int64_t groups = (p1 - p0 + kRows - 1) / kRows;  // as even as they go: 8 rows as 4 + 4, not 6 + 2
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t s = 0; s < slices; ++s) {
        const int64_t q0 = pairs * s / slices, q1 = pairs * (s + 1) / slices;
        const typename W::T* ws = w + b * stride + q0 * 2 * kBlock;
        for (int64_t g = 0, m = p0; g < groups; ++g) {
          const int r = static_cast<int>((p1 - p0) / groups + (g < (p1 - p0) % groups ? 1 : 0));
          const float* xm = x + m * ldx + 2 * q0;
          float* am = acc + (m - p0) * kBlock;
          switch (r) {
            case 6: micro1<W, 6>(xm, ldx, ws, q1 - q0, am, s > 0); break;
            case 5: micro1<W, 5>(xm, ldx, ws, q1 - q0, am, s > 0); break;
            case 4: micro1<W, 4>(xm, ldx, ws, q1 - q0, am, s > 0); break;
            case 3: micro1<W, 3>(xm, ldx, ws, q1 - q0, am, s > 0); break;
            case 2: micro1<W, 2>(xm, ldx, ws, q1 - q0, am, s > 0); break;
            default: micro1<W, 1>(xm, ldx, ws, q1 - q0, am, s > 0); break;
          }
          m += r;
        }
      }
      for (int64_t m = p0; m < p1; ++m) store_block(acc + (m - p0) * kBlock, bias, b * kBlock, n, y + m * n);
    }
  }
}

// x [rows, k] (bfloat16 or fp32, contiguous) -> fp32 [rows, ld], a last odd feature zero. Exact.
void widen(const at::Tensor& x, int64_t rows, int64_t k, int64_t ld, float* out) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  auto rows_to = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* dst = out + r * ld;
      if (bf16) {
        for (int64_t i = 0; i < k; ++i) {
          const uint32_t bits = static_cast<uint32_t>(xb[r * k + i]) << 16;
          std::memcpy(dst + i, &bits, sizeof bits);
        }
      } else {
        std::memcpy(dst, xf + r * k, k * sizeof(float));
      }
      if (ld > k) dst[k] = 0.0f;
    }
  };
  if (rows * k < (1 << 16)) {  // a decode step's rows: not worth waking the pool
    rows_to(0, rows);
  } else {
    at::parallel_for(0, rows, 16, rows_to);
  }
}
#endif

}  // namespace

bool has_avx2_linear() {
#if defined(FLARE_X86)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

at::Tensor linear_avx2(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear_avx2: needs bfloat16 or float32 activations");
  LinearCall call = linear_call("linear_avx2", x, packed, bias, out_features, /*float_weights=*/true);
  if (call.rows == 0) return call.out;
  TORCH_CHECK(has_avx2_linear(), "linear_avx2: this CPU has no AVX2 and FMA");
#if defined(FLARE_X86)
  const int64_t rows = call.rows, k = x.size(-1), pairs = packed.size(1), ld = 2 * pairs;
  const bool direct = x.scalar_type() == at::kFloat && ld == k && x.is_contiguous();
  at::Tensor widened = direct ? x : at::empty({rows, ld}, x.options().dtype(at::kFloat));
  if (!direct) widen(x.contiguous(), rows, k, ld, widened.data_ptr<float>());
  const float* xp = widened.data_ptr<float>();
  const float* bp = call.bias.defined() ? call.bias.data_ptr<float>() : nullptr;
  // Runs of blocks taken in turn (parallel_runs), in multiples of the blocks the rows' path takes at
  // once: wide's groups for one or two rows, few's pairs, single blocks in panels for more.
  const int64_t nblocks = packed.size(0);
  const auto run = [&](auto weights, auto out_type) {
    using W = decltype(weights);
    using Y = decltype(out_type);
    const int64_t unit = rows <= 2 ? kWideBlocks[rows] : few_rows<W>(rows) ? 2 : 1;
    const auto* w = reinterpret_cast<const typename W::T*>(packed.data_ptr());
    Y* y = reinterpret_cast<Y*>(call.out.data_ptr());
    parallel_runs(nblocks, run_length(nblocks, unit), [&](int64_t b0, int64_t b1) {
      blocks<W>(xp, rows, ld, w, pairs, b0, b1, out_features, bp, y);
    });
  };
  const bool f32_weights = packed.scalar_type() == at::kFloat, bf16_out = x.scalar_type() == at::kBFloat16;
  if (f32_weights && bf16_out) run(F32Weights{}, uint16_t{});
  else if (f32_weights) run(F32Weights{}, float{});
  else if (bf16_out) run(Bf16Weights{}, uint16_t{});
  else run(Bf16Weights{}, float{});
#endif
  return call.out;
}

}  // namespace flare_native
