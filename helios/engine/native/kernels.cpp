// helios' native CPU kernels: paged decode attention and KV writes, straight over the paged cache.
//
// Built on the serving host by helios/engine/native/__init__.py (g++ -O3 -march=native) and loaded
// with torch.ops.load_library. The ops live in the flare_native namespace; once loaded, the library
// also serves the CPU slot of flare::paged_attention and flare::write_kv (what it does not cover goes
// to helios' Python kernels, registered as flare_fallback::), and runs AOTInductor steps with the GIL
// released (run_compiled).
//
// linear multiplies bfloat16 activations by bfloat16 weights packed once at load (pack_linear) in
// the layout AVX512-BF16's pair dot product reads: for each block of 16 outputs, each pair of
// input features holds the 16 outputs' two weights side by side. A micro-kernel keeps up to 6 rows
// x 64 outputs of fp32 accumulators in registers and streams one 64-output tile of weights per
// task, so a decode step reads every weight once whatever its row count. linear_tiles reads the
// same packed weights as AMX tiles (CPUs with AMX-BF16), which keeps many rows as cheap as few.
// Built only where the compiler targets AVX512-BF16; helios measures both against oneDNN before
// using either.
//
// decode_attention attends one query token per sequence over that sequence's pages in place: no
// gather of the history into a padded copy, no mask tensor. Each (sequence, kv head) task loads the
// group of query heads sharing that kv head once and streams its keys and values page by page with
// an online softmax in fp32, whatever the cache dtype. Every row is computed on its own, so a row's
// result does not depend on which other rows share the step.
//
// Reproducibility (docs/serving.md): a query row gets the same bits whether it is decoded alone,
// beside other rows, inside a prompt chunk of any length or among drafts under verification. The
// arithmetic of flare::paged_attention is chosen per layer, never per step: bfloat16 layers run
// chunk_rows for chunks and decode rows alike (decode_tiles), others decode_attention for every
// query row. Work is split over rows, heads and output columns, never over one row's reduction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_runner/model_container_runner_cpu.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define FLARE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
inline float load(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }

inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(at::BFloat16* p, int64_t i, float v) { p[i] = static_cast<at::BFloat16>(v); }  // round to nearest even
inline void store(at::Half* p, int64_t i, float v) { p[i] = static_cast<at::Half>(v); }

// exp(x) for x <= 0 (scores minus their running max), vectorizable: 2^(x log2 e) split into an
// integer power built in the exponent bits and a degree-6 polynomial of the fraction. Relative
// error below 2e-7; inputs below -87 flush to 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t);
  const float f = t - n;  // [0, 1)
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

constexpr int kChunk = 64;  // keys scored at a time per head (one online-softmax update each)

constexpr int kMaxDim = 512;

// One (sequence, kv head) task per iteration; DIM > 0 fixes the head size at compile time (the
// common sizes), so the per-key loops unroll into registers; 0 reads it at run time.
template <typename Q, typename C, int DIM>
void decode_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& kv_lens, const at::Tensor& positions,
                 double scale, int64_t window, double softcap, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1);
  const int64_t dim = DIM > 0 ? DIM : q.size(2);
  const int64_t page_tokens = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const Q* qp = q.data_ptr<Q>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  Q* op = out.data_ptr<Q>();
  const int64_t token_stride = kv_heads * dim;  // between consecutive slots of a page
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), scores(group * kChunk), m(group), l(group);
    alignas(64) float row[kMaxDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / kv_heads, kvh = task % kv_heads;
      const int64_t length = std::min(lens[seq], pos[seq] + 1);  // keys j <= position that are written
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos[seq] - window + 1) : 0;
      const int32_t* table = tables + seq * max_blocks;
      const int64_t reachable = std::min(length, max_blocks * page_tokens);
      for (int64_t g = 0; g < group; ++g) {
        const Q* src = qp + (seq * heads + kvh * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = load(src, d) * (cap > 0.0f ? 1.0f : fscale);
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.0f;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t start = first; start < reachable; start += kChunk) {
        const int64_t count = std::min<int64_t>(kChunk, reachable - start);
        for (int64_t t = 0; t < count; ++t) {
          const int64_t j = start + t;
          const C* __restrict key = kp + (table[j / page_tokens] * page_tokens + j % page_tokens) * token_stride + kvh * dim;
          for (int64_t d = 0; d < dim; ++d) row[d] = load(key, d);
          for (int64_t g = 0; g < group; ++g) {
            const float* __restrict qg = qf.data() + g * dim;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < dim; ++d) s += qg[d] * row[d];
            if (cap > 0.0f) s = cap * std::tanh(s * fscale / cap);
            scores[g * kChunk + t] = s;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* __restrict sg = scores.data() + g * kChunk;
          float top = m[g];
          for (int64_t t = 0; t < count; ++t) top = std::max(top, sg[t]);
          const float rescale = exp_nonpositive(m[g] - top);  // 0 on the first chunk (m = -inf)
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < count; ++t) {
            sg[t] = exp_nonpositive(sg[t] - top);
            sum += sg[t];
          }
          l[g] = l[g] * rescale + sum;
          m[g] = top;
          float* __restrict ag = acc.data() + g * dim;
          for (int64_t d = 0; d < dim; ++d) ag[d] *= rescale;
        }
        for (int64_t t = 0; t < count; ++t) {
          const int64_t j = start + t;
          const C* __restrict value = vp + (table[j / page_tokens] * page_tokens + j % page_tokens) * token_stride + kvh * dim;
          for (int64_t d = 0; d < dim; ++d) row[d] = load(value, d);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * kChunk + t];
            float* __restrict ag = acc.data() + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) ag[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        Q* dst = op + (seq * heads + kvh * group + g) * dim;
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int64_t d = 0; d < dim; ++d) store(dst, d, acc[g * dim + d] * inv);
      }
    }
  });
}

template <typename Q, typename C>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& positions, double scale,
                  int64_t window, double softcap, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return decode_rows<Q, C, 64>(q, k_cache, v_cache, tables, lens, positions, scale, window, softcap, out);
    case 128: return decode_rows<Q, C, 128>(q, k_cache, v_cache, tables, lens, positions, scale, window, softcap, out);
    case 256: return decode_rows<Q, C, 256>(q, k_cache, v_cache, tables, lens, positions, scale, window, softcap, out);
    default: return decode_rows<Q, C, 0>(q, k_cache, v_cache, tables, lens, positions, scale, window, softcap, out);
  }
}

template <typename Q>
void dispatch_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& positions, double scale,
                    int64_t window, double softcap, at::Tensor& out) {
  switch (k_cache.scalar_type()) {
    case at::kFloat: return dispatch_dim<Q, float>(q, k_cache, v_cache, tables, lens, positions, scale, window, softcap, out);
    case at::kBFloat16: return dispatch_dim<Q, at::BFloat16>(q, k_cache, v_cache, tables, lens, positions, scale, window, softcap, out);
    case at::kHalf: return dispatch_dim<Q, at::Half>(q, k_cache, v_cache, tables, lens, positions, scale, window, softcap, out);
    default: TORCH_CHECK(false, "decode_attention: unsupported cache dtype ", k_cache.scalar_type());
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& kv_lens, const at::Tensor& positions,
                            double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "decode_attention: shapes");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0 && q.size(2) <= kMaxDim,
              "decode_attention: head layout");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "decode_attention: caches must be contiguous and of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == q.size(0),
              "decode_attention: block_tables must be int32 [rows, blocks]");
  const at::Tensor qc = q.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = kv_lens.to(at::kLong).contiguous();
  const at::Tensor where = positions.to(at::kLong).contiguous();
  TORCH_CHECK(lens.numel() == q.size(0) && where.numel() == q.size(0), "decode_attention: one length and position per row");
  at::Tensor out = at::empty_like(qc);
  switch (qc.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(qc, k_cache, v_cache, tables, lens, where, scale, window, softcap, out); break;
    case at::kBFloat16: dispatch_cache<at::BFloat16>(qc, k_cache, v_cache, tables, lens, where, scale, window, softcap, out); break;
    case at::kHalf: dispatch_cache<at::Half>(qc, k_cache, v_cache, tables, lens, where, scale, window, softcap, out); break;
    default: TORCH_CHECK(false, "decode_attention: unsupported query dtype ", qc.scalar_type());
  }
  return out;
}

// k/v [tokens, kv_heads, dim] into the caches' flat slots; a negative slot is padding and skipped.
void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "write_kv: caches must be contiguous");
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  const int64_t slots_total = k_cache.size(0) * k_cache.size(1);
  const at::Tensor kc = k.to(k_cache.scalar_type()).contiguous().view({-1, row});
  const at::Tensor vc = v.to(v_cache.scalar_type()).contiguous().view({-1, row});
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(kc.size(0) == slots.numel() && vc.size(0) == slots.numel(), "write_kv: one slot per token");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t bytes = row * k_cache.element_size();
  auto* kd = static_cast<char*>(k_cache.data_ptr());
  auto* vd = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(kc.data_ptr());
  const auto* vs = static_cast<const char*>(vc.data_ptr());
  for (int64_t i = 0; i < slots.numel(); ++i) {
    const int64_t slot = sp[i];
    if (slot < 0) continue;
    TORCH_CHECK(slot < slots_total, "write_kv: slot ", slot, " is outside the cache");
    std::memcpy(kd + slot * bytes, ks + i * bytes, bytes);
    std::memcpy(vd + slot * bytes, vs + i * bytes, bytes);
  }
}

// ---------------------------------------------------------------------------------------- linear
constexpr int64_t kBlock = 16;  // outputs per packed block (one zmm of fp32 accumulators)

bool has_bf16_linear() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// w [N, K] bfloat16 -> [ceil(N / 16), K / 2, 16, 2]; outputs past N are zero.
at::Tensor pack_linear(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_linear: needs a 2-D bfloat16 weight");
  TORCH_CHECK(w.size(1) % 2 == 0, "pack_linear: the input size must be even");
  const int64_t n = w.size(0), k = w.size(1), padded = (n + kBlock - 1) / kBlock * kBlock;
  at::Tensor full = w.contiguous();
  if (padded != n) full = at::cat({full, at::zeros({padded - n, k}, w.options())});
  return full.view({padded / kBlock, kBlock, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512BF16__)
template <int MR, int NB>
inline void micro(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, float* out) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t stride = pairs * 2 * kBlock;  // elements between consecutive 16-output blocks
  for (int64_t k = 0; k < pairs; ++k) {
    __m512bh b[NB];
    for (int j = 0; j < NB; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * stride + k * 2 * kBlock);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * k, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, b[j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + (m * NB + j) * kBlock, acc[m][j]);
}

// One row's 16 fp32 results of block `first / 16` (+ bias), rounded to bfloat16 (nearest even, as
// torch's cast) into out[first:], masked past n.
inline void store_block(const float* acc, const float* bias, int64_t first, int64_t n, uint16_t* out) {
  __m512 v = _mm512_loadu_ps(acc);
  const __mmask16 keep = n - first >= kBlock ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - first)) - 1);
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + first));
  _mm256_mask_storeu_epi16(out + first, keep, (__m256i)_mm512_cvtneps_pbh(v));
}

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
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features, bool amx) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && packed.dim() == 4,
              "linear: needs bfloat16 activations and a pack_linear weight");
  const int64_t k = packed.size(1) * 2;
  TORCH_CHECK(x.size(-1) == k, "linear: input size ", x.size(-1), " does not match the weight's ", k);
  TORCH_CHECK(out_features > 0 && out_features <= packed.size(0) * kBlock, "linear: out_features out of range");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor y = at::empty(shape, x.options());
  const int64_t rows = x.numel() / k;
  if (rows == 0) return y;
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features, "linear: bias size");
    bias_f = bias->to(at::kFloat).contiguous();
  }
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

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out_features) {
  return linear_impl(x, packed, bias, out_features, false);
}

at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        int64_t out_features) {
  return linear_impl(x, packed, bias, out_features, true);
}

// --------------------------------------------------------------------------- prefill attention
// One chunk of a sequence's queries (a prompt chunk, or drafts under verification) over its keys,
// bfloat16 throughout, on the same register micro-kernel as linear: keys and values are packed
// once per chunk and kv head in 64-key tiles (keys: pairs of head features x 16 keys; values:
// pairs of keys x 16 features), then each task takes up to 6 query rows of one head through the
// tiles in order with an online softmax in fp32 (probabilities rounded to bfloat16 for the value
// product, as SDPA's bfloat16 kernel does). Tiles no row of a task can see are skipped, and a tile
// contributes exactly nothing to a row that sees none of it, so a row's result depends only on its
// own position and the keys: it is the same whichever chunk or neighbours it comes with.
constexpr int64_t kTile = 64;  // keys per tile (4 blocks of 16)

bool chunk_attention_supported(const at::Tensor& q, const at::Tensor& k_cache) {
#if defined(__AVX512BF16__)
  return q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && q.size(2) % 64 == 0 &&
         q.size(2) <= 256;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
// One 64-key tile of one kv head: key c's features at keys[c] (nullptr: past the end, zeros).
// keys   -> [4 blocks][dim / 2 pairs][16 keys][2]
// values -> [dim / 16 blocks][32 key pairs][16 features][2]
// dim is a multiple of 64 (chunk_attention_supported). Keys move as 32-bit feature pairs; values
// interleave two keys' 16 features with one permute per 32 outputs.
void pack_tile(const uint16_t* const* keys, const uint16_t* const* values, int64_t dim, uint16_t* kt, uint16_t* vt) {
  const int64_t pairs = dim / 2;
  for (int64_t c = 0; c < kTile; ++c) {  // key block, feature pair, key lane, pair member
    uint16_t* out = kt + ((c / kBlock) * pairs * kBlock + c % kBlock) * 2;
    const uint16_t* key = keys[c];
    for (int64_t p = 0; p < pairs; ++p) {
      uint32_t pair = 0;
      if (key != nullptr) std::memcpy(&pair, key + 2 * p, sizeof(pair));
      std::memcpy(out + p * kBlock * 2, &pair, sizeof(pair));
    }
  }
  // feature block, key pair, feature lane, pair member: lane f of key pair (c, c + 1) holds
  // (value[c][f], value[c + 1][f]).
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t c = 0; c < kTile; c += 2) {
    const uint16_t* first = values[c];
    const uint16_t* second = values[c + 1];
    for (int64_t block = 0; block < dim / kBlock; ++block) {
      const __m256i a =
          first != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + block * kBlock)) : zero;
      const __m256i b =
          second != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + block * kBlock)) : zero;
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      _mm512_storeu_si512(vt + ((block * (kTile / 2) + c / 2) * kBlock) * 2, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// keys/values [held, kv_heads, dim] -> per kv head, per tile: pack_tile's layout.
void pack_tiles(const uint16_t* keys, const uint16_t* values, int64_t held, int64_t kv_heads, int64_t dim,
                uint16_t* kp, uint16_t* vp) {
  const int64_t tiles = (held + kTile - 1) / kTile, tile_elems = kTile * dim;
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    const uint16_t* kr[kTile];
    const uint16_t* vr[kTile];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / tiles, t = task % tiles;
      for (int64_t c = 0; c < kTile; ++c) {
        const int64_t j = t * kTile + c;
        kr[c] = j < held ? keys + (j * kv_heads + h) * dim : nullptr;
        vr[c] = j < held ? values + (j * kv_heads + h) * dim : nullptr;
      }
      pack_tile(kr, vr, dim, kp + (h * tiles + t) * tile_elems, vp + (h * tiles + t) * tile_elems);
    }
  });
}

// exp_nonpositive on 16 lanes (same polynomial; 2^n applied with scalef).
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

template <int MR>
void chunk_rows(const uint16_t* q, int64_t ldq, const int64_t* where, const uint16_t* kp, const uint16_t* vp,
                int64_t tiles, int64_t dim, int64_t key0, int64_t held, float scale, int64_t window, float* o_acc,
                uint16_t* out, int64_t ldo) {
  constexpr int NB = 4;
  const int64_t pairs = dim / 2, tile_elems = kTile * dim;
  alignas(64) float scores[MR * kTile];
  alignas(64) uint16_t probs[MR * kTile];
  alignas(64) float part[MR * NB * kBlock];
  float m[MR], l[MR];
  for (int r = 0; r < MR; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  std::fill(o_acc, o_acc + MR * dim, 0.0f);
  int64_t lo = key0, hi = key0;
  for (int r = 0; r < MR; ++r) hi = std::max(hi, std::min<int64_t>(where[r] + 1, key0 + held));
  if (window > 0) {
    lo = where[0] - window + 1;
    for (int r = 1; r < MR; ++r) lo = std::min(lo, where[r] - window + 1);
    lo = std::max(lo, key0);
  }
  for (int64_t t = (lo - key0) / kTile; t < tiles && key0 + t * kTile < hi; ++t) {
    micro<MR, NB>(q, ldq, kp + t * tile_elems, pairs, scores);  // scores[r][c]: (r * 4 + c / 16) * 16 + c % 16
    const int64_t first = key0 + t * kTile;  // absolute position of the tile's first key
    for (int r = 0; r < MR; ++r) {
      float* s = scores + r * kTile;
      const int64_t last = std::min<int64_t>(where[r], key0 + held - 1);  // visible: floor <= j <= last
      const int64_t floor = window > 0 ? where[r] - window + 1 : first;
      uint16_t* pr = probs + r * kTile;
      if (last < first || floor > first + kTile - 1) {  // sees none of this tile: contributes nothing
        std::memset(pr, 0, sizeof(uint16_t) * kTile);
        continue;
      }
      const bool whole = last >= first + kTile - 1 && floor <= first;
      __m512 v[4];
      __mmask16 keep[4];
      __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int b = 0; b < 4; ++b) {
        v[b] = _mm512_mul_ps(_mm512_loadu_ps(s + b * kBlock), _mm512_set1_ps(scale));
        if (whole) {
          keep[b] = 0xFFFF;
        } else {  // lanes j = first + 16 b + lane with floor <= j <= last
          const int64_t lo = std::max<int64_t>(floor - first - b * kBlock, 0);
          const int64_t hi = std::min<int64_t>(last - first - b * kBlock, kBlock - 1);
          keep[b] = hi < lo ? 0 : static_cast<__mmask16>(((1u << (hi + 1)) - 1) & ~((1u << lo) - 1));
        }
        top = _mm512_mask_max_ps(top, keep[b], top, v[b]);
      }
      const float next = std::max(m[r], _mm512_reduce_max_ps(top));
      const float rescale = m[r] == -std::numeric_limits<float>::infinity() ? 0.0f : exp_nonpositive(m[r] - next);
      __m512 total = _mm512_setzero_ps();
      for (int b = 0; b < 4; ++b) {
        const __m512 p = _mm512_maskz_mov_ps(keep[b], exp_nonpositive16(_mm512_sub_ps(v[b], _mm512_set1_ps(next))));
        total = _mm512_add_ps(total, p);
        const __m256bh h = _mm512_cvtneps_pbh(p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + b * kBlock), (__m256i)h);
      }
      l[r] = l[r] * rescale + _mm512_reduce_add_ps(total);
      m[r] = next;
      if (rescale != 1.0f)
        for (int64_t d = 0; d < dim; ++d) o_acc[r * dim + d] *= rescale;
    }
    const uint16_t* vt = vp + t * tile_elems;
    for (int64_t base = 0; base < dim; base += NB * kBlock) {  // 64 features per product
      micro<MR, NB>(probs, kTile, vt + (base / kBlock) * (kTile / 2) * 2 * kBlock, kTile / 2, part);
      for (int r = 0; r < MR; ++r)
        for (int64_t d = 0; d < NB * kBlock; ++d) o_acc[r * dim + base + d] += part[r * NB * kBlock + d];
    }
  }
  for (int r = 0; r < MR; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < dim; d += kBlock) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o_acc + r * dim + d), _mm512_set1_ps(inv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + d), (__m256i)h);
    }
  }
}
#endif

// q [Tq, heads, dim] of one chunk, keys/values [held, kv_heads, dim] (key i at absolute position
// key0 + i), positions [Tq]; returns [Tq, heads, dim].
at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& positions, int64_t key0, double scale, int64_t window) {
#if defined(__AVX512BF16__)
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t held = keys.size(0), kv_heads = keys.size(1), group = heads / kv_heads;
  const int64_t tiles = (held + kTile - 1) / kTile;
  const at::Tensor qc = q.contiguous(), kc = keys.contiguous(), vc = values.contiguous();
  const at::Tensor where = positions.to(at::kLong).contiguous();
  at::Tensor kpack = at::empty({kv_heads * tiles * kTile * dim}, q.options());
  at::Tensor vpack = at::empty({kv_heads * tiles * kTile * dim}, q.options());
  auto* kp = reinterpret_cast<uint16_t*>(kpack.data_ptr());
  auto* vp = reinterpret_cast<uint16_t*>(vpack.data_ptr());
  pack_tiles(reinterpret_cast<const uint16_t*>(kc.data_ptr()), reinterpret_cast<const uint16_t*>(vc.data_ptr()),
             held, kv_heads, dim, kp, vp);
  at::Tensor out = at::empty_like(qc);
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t* wp = where.data_ptr<int64_t>();
  const int64_t blocks = (rows + 5) / 6, tasks = blocks * heads;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(6 * dim);
    for (int64_t task = begin; task < end; ++task) {
      // Later rows see more keys: alternate light and heavy row blocks so each thread's
      // contiguous share of tasks costs about the same.
      const int64_t pair = task / heads, head = task % heads;
      const int64_t block = pair % 2 == 0 ? pair / 2 : blocks - 1 - pair / 2;
      const int64_t r0 = block * 6, count = std::min<int64_t>(6, rows - r0);
      const int64_t kvh = head / group;
      const uint16_t* x = qp + (r0 * heads + head) * dim;
      uint16_t* y = op + (r0 * heads + head) * dim;
      const uint16_t* kt = kp + kvh * tiles * kTile * dim;
      const uint16_t* vt = vp + kvh * tiles * kTile * dim;
      const int64_t* w = wp + r0;
      const int64_t ld = heads * dim;
      switch (count) {
        case 6: chunk_rows<6>(x, ld, w, kt, vt, tiles, dim, key0, held, fscale, window, acc.data(), y, ld); break;
        case 5: chunk_rows<5>(x, ld, w, kt, vt, tiles, dim, key0, held, fscale, window, acc.data(), y, ld); break;
        case 4: chunk_rows<4>(x, ld, w, kt, vt, tiles, dim, key0, held, fscale, window, acc.data(), y, ld); break;
        case 3: chunk_rows<3>(x, ld, w, kt, vt, tiles, dim, key0, held, fscale, window, acc.data(), y, ld); break;
        case 2: chunk_rows<2>(x, ld, w, kt, vt, tiles, dim, key0, held, fscale, window, acc.data(), y, ld); break;
        default: chunk_rows<1>(x, ld, w, kt, vt, tiles, dim, key0, held, fscale, window, acc.data(), y, ld); break;
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "chunk_attention: this build has no AVX512-BF16 kernel");
#endif
}

// Decode rows (one query token per sequence) on chunk_attention's arithmetic, read in place: each
// (sequence, kv head) task packs that head's keys and values tile by tile from the pages, in tiles
// starting at absolute multiples of 64 keys as a chunk's are, and takes the query heads sharing
// them through chunk_rows. A query row's result is then bit-identical whether it was decoded alone,
// beside other rows, or computed inside a prompt chunk or a verification chunk of any length.
// q [rows, heads, dim] bfloat16, caches bfloat16; kv_lens and positions int64 [rows].
void decode_tiles(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& kv_lens, const at::Tensor& positions, double scale,
                  int64_t window, at::Tensor& out) {
#if defined(__AVX512BF16__)
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t page_tokens = k_cache.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1), token_stride = kv_heads * dim, tile_elems = kTile * dim;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  const int64_t* where = positions.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> kpack, vpack;
    std::vector<float> acc(6 * dim);
    const uint16_t* kr[kTile];
    const uint16_t* vr[kTile];
    int64_t at_pos[6];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / kv_heads, kvh = task % kv_heads, pos = where[seq];
      const int64_t stop = std::min({lens[seq], pos + 1, max_blocks * page_tokens});  // keys j < stop are visible
      const int64_t key0 = window > 0 ? std::max<int64_t>(0, pos - window + 1) / kTile * kTile : 0;
      const int64_t held = std::max<int64_t>(0, stop - key0), tiles = (held + kTile - 1) / kTile;
      if (static_cast<int64_t>(kpack.size()) < tiles * tile_elems) {
        kpack.resize(tiles * tile_elems);
        vpack.resize(tiles * tile_elems);
      }
      const int32_t* table = tables + seq * max_blocks;
      for (int64_t t = 0; t < tiles; ++t) {
        for (int64_t c = 0; c < kTile; ++c) {
          const int64_t j = key0 + t * kTile + c;
          const int64_t slot = j < stop ? table[j / page_tokens] * page_tokens + j % page_tokens : -1;
          kr[c] = slot >= 0 ? kc + slot * token_stride + kvh * dim : nullptr;
          vr[c] = slot >= 0 ? vc + slot * token_stride + kvh * dim : nullptr;
        }
        pack_tile(kr, vr, dim, kpack.data() + t * tile_elems, vpack.data() + t * tile_elems);
      }
      std::fill(at_pos, at_pos + 6, pos);
      for (int64_t g0 = 0; g0 < group; g0 += 6) {
        const int64_t count = std::min<int64_t>(6, group - g0), first = (seq * heads + kvh * group + g0) * dim;
        const uint16_t* x = qp + first;
        uint16_t* y = op + first;
        const uint16_t* kt = kpack.data();
        const uint16_t* vt = vpack.data();
        switch (count) {
          case 6: chunk_rows<6>(x, dim, at_pos, kt, vt, tiles, dim, key0, held, fscale, window, acc.data(), y, dim); break;
          case 5: chunk_rows<5>(x, dim, at_pos, kt, vt, tiles, dim, key0, held, fscale, window, acc.data(), y, dim); break;
          case 4: chunk_rows<4>(x, dim, at_pos, kt, vt, tiles, dim, key0, held, fscale, window, acc.data(), y, dim); break;
          case 3: chunk_rows<3>(x, dim, at_pos, kt, vt, tiles, dim, key0, held, fscale, window, acc.data(), y, dim); break;
          case 2: chunk_rows<2>(x, dim, at_pos, kt, vt, tiles, dim, key0, held, fscale, window, acc.data(), y, dim); break;
          default: chunk_rows<1>(x, dim, at_pos, kt, vt, tiles, dim, key0, held, fscale, window, acc.data(), y, dim); break;
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "decode_tiles: this build has no AVX512-BF16 kernel");
#endif
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = c10::SymInt(out_features);
  return at::empty_symint(shape, x.options());
}

// ------------------------------------------------------------------- the flare:: ops' CPU kernels
// The compiled step calls flare::paged_attention and flare::write_kv through the dispatcher once per
// layer. Served from C++, a decode step never takes the GIL (the HTTP thread keeps streaming while
// it runs); the steps these kernels do not cover go to the Python kernels, which helios registers
// as flare_fallback:: (helios/engine/kernels.py) and which compute the same rows the same way.

at::Tensor attention_fallback(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& query_start_loc, const at::Tensor& positions, double scale,
                              int64_t window, double softcap) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flare_fallback::paged_attention", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, double, int64_t, double)>();
  return op.call(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window, softcap);
}

at::Tensor index_of(const std::vector<int64_t>& values) {
  return at::from_blob(const_cast<int64_t*>(values.data()), {static_cast<int64_t>(values.size())}, at::kLong).clone();
}

// Which arithmetic attends a layer's rows depends only on the layer (dtype, head size, soft-capping),
// never on the step's shape, so a query row gets the same bits whatever it shares the step with:
// * tiled (bfloat16, head size a multiple of 64 up to 256, no soft-capping, AVX512-BF16): chunks
//   run chunk_attention over their gathered pages, decode rows decode_tiles in place, both on
//   chunk_rows with 64-key tiles aligned to absolute key positions;
// * otherwise every query row, of a chunk or a decode, is a decode_attention row of its sequence.
// Layouts neither covers go to the Python kernels whole.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, const at::Tensor& positions, double scale,
                           int64_t window, double softcap) {
  const bool in_place = q.dim() == 3 && k_cache.dim() == 4 && k_cache.size(3) <= kMaxDim &&
                        q.size(2) == k_cache.size(3) && k_cache.sizes() == v_cache.sizes() &&
                        k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() &&
                        v_cache.is_contiguous() && block_tables.scalar_type() == at::kInt &&
                        query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                        seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                        positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                        query_start_loc.numel() == seq_lens.numel() + 1 && q.size(1) % k_cache.size(2) == 0;
  if (!in_place)
    return attention_fallback(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window,
                              softcap);
  const bool tiled = chunk_attention_supported(q, k_cache) && softcap <= 0.0;
  const int64_t seqs = seq_lens.numel();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  std::vector<int64_t> picked, rows, chunks;
  for (int64_t i = 0; i < seqs; ++i) {
    const int32_t len = starts[i + 1] - starts[i];
    if (len == 1 || (len > 1 && !tiled)) {  // rows attended one by one: (sequence, row) pairs
      for (int64_t r = starts[i]; r < starts[i + 1]; ++r) {
        picked.push_back(i);
        rows.push_back(r);
      }
    } else if (len > 1) {
      chunks.push_back(i);
    }
  }
  const bool all_rows = chunks.empty() && static_cast<int64_t>(rows.size()) == q.size(0) &&
                        static_cast<int64_t>(picked.size()) == seqs && starts[seqs] == seqs;
  if (all_rows && !tiled)
    return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, positions, scale, window, softcap);
  at::Tensor out = starts[seqs] < q.size(0) ? at::zeros_like(q) : at::empty_like(q);
  if (!rows.empty()) {
    const at::Tensor seq_index = index_of(picked), row_index = index_of(rows);
    const at::Tensor query = q.index_select(0, row_index).contiguous();
    const at::Tensor tables = block_tables.index_select(0, seq_index).contiguous();
    const at::Tensor lens = seq_lens.index_select(0, seq_index);
    const at::Tensor where = positions.index_select(0, row_index).contiguous();
    at::Tensor attended;
    if (tiled) {
      attended = at::empty_like(query);
      decode_tiles(query, k_cache, v_cache, tables, lens.to(at::kLong).contiguous(), where, scale, window, attended);
    } else {
      attended = decode_attention(query, k_cache, v_cache, tables, lens, where, scale, window, softcap);
    }
    if (all_rows) return attended;
    out.index_copy_(0, row_index, attended);
  }
  const int64_t page_tokens = k_cache.size(1), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  // A windowed chunk gathers from a page whose first key sits at a multiple of 64 (the tiles'
  // absolute alignment): the least common multiple of the tile and the page.
  const int64_t align = std::lcm<int64_t>(kTile, page_tokens);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* where = positions.data_ptr<int64_t>();
  for (const int64_t i : chunks) {
    const int64_t start = starts[i], end = starts[i + 1], kv_len = lens[i];
    const int64_t first_key = window > 0 ? std::max<int64_t>(where[start] - window + 1, 0) / align * align : 0;
    const int64_t first = first_key / page_tokens;
    const at::Tensor pages =
        block_tables.select(0, i).slice(0, first, (kv_len + page_tokens - 1) / page_tokens).to(at::kLong);
    const int64_t held = kv_len - first_key;
    const at::Tensor gathered_k = k_cache.index_select(0, pages).view({-1, kv_heads, dim}).slice(0, 0, held);
    const at::Tensor gathered_v = v_cache.index_select(0, pages).view({-1, kv_heads, dim}).slice(0, 0, held);
    out.slice(0, start, end).copy_(chunk_attention(q.slice(0, start, end), gathered_k, gathered_v,
                                                   positions.slice(0, start, end), first_key, scale, window));
  }
  return out;
}

void write_kv_op(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& slot_mapping) {
  if (k_cache.is_contiguous() && v_cache.is_contiguous()) return write_kv(k_cache, v_cache, k, v, slot_mapping);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flare_fallback::write_kv", "")
                             .typed<void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  op.call(k_cache, v_cache, k, v, slot_mapping);
}

// ------------------------------------------------------------------------------- compiled steps
// torch's Python binding of the AOTInductor runner holds the GIL for the whole step, so the HTTP
// thread cannot stream a token while the next one is computed. Called as an op, the same runner
// runs with the GIL released (torch.ops calls drop it).
struct CompiledStep : torch::CustomClassHolder {
  explicit CompiledStep(const std::string& path) : runner(path, 1) {}
  torch::inductor::AOTIModelContainerRunnerCpu runner;
};

std::vector<at::Tensor> run_compiled(const c10::intrusive_ptr<CompiledStep>& step, const std::vector<at::Tensor>& inputs) {
  return step->runner.run(inputs);
}

}  // namespace

TORCH_LIBRARY(flare_native, m) {
  m.class_<CompiledStep>("CompiledStep").def(torch::init<std::string>());
  m.def("run_compiled(__torch__.torch.classes.flare_native.CompiledStep step, Tensor[] inputs) -> Tensor[]", &run_compiled);
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor kv_lens, "
        "Tensor positions, float scale, int window, float softcap) -> Tensor");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("has_bf16_linear() -> bool", &has_bf16_linear);
  m.def("has_amx_linear() -> bool", &has_amx_linear);
  m.def("pack_linear(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_tiles(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("chunk_attention(Tensor q, Tensor keys, Tensor values, Tensor positions, int key0, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(flare_native, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("write_kv", &write_kv);
  m.impl("pack_linear", &pack_linear);
  m.impl("linear", &linear);
  m.impl("linear_tiles", &linear_tiles);
  m.impl("chunk_attention", &chunk_attention);
}

TORCH_LIBRARY_IMPL(flare_native, Meta, m) {
  m.impl("linear", &linear_meta);
  m.impl("linear_tiles", &linear_meta);
}

TORCH_LIBRARY(flare_fallback, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, Tensor positions, float scale, int window, float softcap) -> Tensor");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(flare, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv_op);
}

// The KV caches are never autograd inputs: skip custom_op's Python ADInplaceOrView kernel (a
// version-counter bump and a redispatch, in Python, on every layer's write).
TORCH_LIBRARY_IMPL(flare, ADInplaceOrView, m) { m.impl("write_kv", torch::CppFunction::makeFallthrough()); }
