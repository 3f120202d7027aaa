// helios' native CPU kernels: what every source of the library shares.
//
// The library (built on the serving host by helios/engine/native/__init__.py: g++ -O3 with the
// host's -march, every .cpp of this directory, loaded with torch.ops.load_library) holds:
//   attention.cpp        decode_attention (one query row per sequence over its pages, any dtype and
//                        instruction set) and write_kv;
//   attention_tiles.cpp  chunk_attention and tiles_in_place: bfloat16 attention on the AVX512-BF16
//                        micro-kernel (avx512_bf16.h), 64-key tiles at absolute positions;
//   attention_avx2.cpp   avx2_attention: every query row of a step (chunks and decode rows) on
//                        AVX2+FMA, fp32 or bfloat16, 64-key tiles at absolute positions, in place;
//   linear_pack.cpp      pack_linear, the packed weight layout every native linear reads;
//   linear_avx512.cpp    linear / linear_tiles: AVX512-BF16 pair dot products and AMX tiles;
//   linear_avx2.cpp      linear_avx2: AVX2+FMA, bfloat16 widened to fp32 in registers (any x86-64
//                        CPU with AVX2, compiled with a target attribute whatever -march is);
//   linear_q.cpp         pack_qlinear / qlinear: int8 and int4 weights (helios/core/quant.py's layout)
//                        times float activations, and its AVX-512 kernel (linear_q.h, linear_q_kernel.h);
//   linear_q_avx2.cpp    qlinear's AVX2+FMA kernel (compiled without AVX-512, like linear_avx2.cpp);
//   linear_qa.cpp        the int8-activation layout of pack_qlinear (act_bits=8) and its AVX512-VNNI
//                        kernel (linear_qa.h, linear_qa_kernel.h): Q8_0-style activations, vpdpbusd;
//   linear_qa_avx2.cpp   its AVX2 kernel (vpmaddubsw; compiled without AVX-512);
//   packed_pages.cpp     keep_packed / forget_packed: tile-layout copies of full bfloat16 KV pages
//                        that tiles_in_place reads instead of packing the history at every step;
//   sampling.cpp         nucleus_draw: a temperature + top-p (+ min-p) row's whole draw, its
//                        candidates found in two passes (helios/engine/sampler.py);
//   topk.cpp             topk_rows: each row's k largest entries in one pass (a compiled step's
//                        top-logprob outputs; ignition/compiled.py points torch.topk at it);
//   ops.cpp              the op schemas, and the CPU kernels of flare::paged_attention/write_kv;
//   compiled_step.cpp    run_compiled: AOTInductor steps with the GIL released.
//
// Reproducibility (docs/serving.md): a query row gets the same bits whether it is decoded alone,
// beside other rows, inside a prompt chunk of any length or among drafts under verification. Work
// is split over rows, heads and output columns, never over one row's reduction, and a row's
// reduction order never depends on how many rows share the call.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

namespace flare_native {

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
// The vector forms (exp8 in attention_avx2.cpp, exp_nonpositive16 in attention_tiles.cpp) evaluate
// the same polynomial, kExpFraction (2^f on [0, 1), highest degree first), with fused multiply-adds.
constexpr float kExpFraction[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                   5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f,
                                   1.0f};
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t);
  const float f = t - n;  // [0, 1)
  float p = kExpFraction[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExpFraction[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// f(begin, end) over [0, n) in runs of `chunk` that the pool's threads take in turn from one atomic
// counter, instead of one fixed share each. On a host whose cores are shared (the HTTP side, the
// load generator, a neighbour VM), a thread that is descheduled mid-call otherwise leaves its whole
// share undone while the others wait at the region's end; taken in turn, the running threads do
// the rest and only the run in hand waits. Which thread computes a run never changes its bits.
template <typename F>
void parallel_runs(int64_t n, int64_t chunk, const F& f) {
  chunk = std::max<int64_t>(1, chunk);
  const int64_t runs = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), runs);
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(chunk); b < n; b = next.fetch_add(chunk)) f(b, std::min(n, b + chunk));
  });
}

// The run length for n output blocks: about `per_thread` runs for each thread, a multiple of `unit`
// (the kernel's widest group of blocks) where there are enough blocks for that, else an even share.
inline int64_t run_length(int64_t n, int64_t unit, int64_t per_thread = 8) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t even = (n + threads - 1) / threads;
  if (n < threads * unit * 2) return even;
  const int64_t want = std::max<int64_t>(unit, n / (threads * per_thread));
  return std::min(even, (want + unit - 1) / unit * unit);
}

constexpr int kChunk = 64;  // keys scored at a time per head (one online-softmax update each)

constexpr int kMaxDim = 512;

constexpr int64_t kBlock = 16;  // outputs per packed linear block
constexpr int64_t kTile = 64;   // keys per attention tile (4 blocks of 16)
constexpr int64_t kBlocksPerTile = kTile / kBlock;

// attention.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& kv_lens, const at::Tensor& positions,
                            double scale, int64_t window, double softcap);
void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping);

// attention_tiles.cpp
bool chunk_attention_supported(const at::Tensor& q, const at::Tensor& k_cache);
at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& positions, int64_t key0, double scale, int64_t window);
// Chunks of at most this many rows are attended where their pages lie, beside the decode rows.
constexpr int64_t kInPlaceRows = 8;
void tiles_in_place(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                    const at::Tensor& positions, const std::vector<int64_t>& seqs, double scale, int64_t window,
                    at::Tensor& out);

// packed_pages.cpp
// A kept cache's packed copy: per page and kv head, the page's 16-key blocks in tiles_in_place's
// layout (keys then values, each page_tokens x dim elements, at the page's own offset), and whether
// that copy holds the page's current bytes.
struct PackedPages {
  static constexpr uint8_t kStale = 0, kPacking = 1, kPacked = 2;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
  c10::weak_intrusive_ptr<c10::StorageImpl> v_storage{c10::intrusive_ptr<c10::StorageImpl>()};
  int64_t pages = 0, page_tokens = 0, kv_heads = 0, dim = 0;
  at::Tensor k, v;
  std::unique_ptr<std::atomic<uint8_t>[]> state;  // [pages * kv_heads]
  // Key (or value) block `block` (16 keys) of page `page`, kv head `kvh`.
  uint16_t* at(bool values, int64_t page, int64_t kvh, int64_t block) const {
    auto* base = reinterpret_cast<uint16_t*>((values ? v : k).data_ptr());
    return base + ((page * kv_heads + kvh) * (page_tokens / kBlock) + block) * kBlock * dim;
  }
};
bool keep_packed(const at::Tensor& k_cache, const at::Tensor& v_cache);
// The caches' packed copy when kept (keep_packed) and still the same caches, else null.
std::shared_ptr<PackedPages> packed_pages_of(const at::Tensor& k_cache, const at::Tensor& v_cache);
// Marks pages[i] / divisor stale (negative entries skipped): divisor 1 for pages, page_tokens for slots.
void forget_pages(const at::Tensor& k_cache, const int64_t* pages, int64_t n, int64_t divisor);
void forget_packed(const at::Tensor& k_cache, const at::Tensor& pages);

// attention_avx2.cpp
bool avx2_attention_supported(const at::Tensor& q, const at::Tensor& k_cache);
at::Tensor avx2_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                          const at::Tensor& positions, double scale, int64_t window, double softcap);

// linear_pack.cpp
at::Tensor pack_linear(const at::Tensor& w);
at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features);
// Checks x against the packed weight and returns (the output, allocated; rows; bias as fp32 or undefined).
struct LinearCall {
  at::Tensor out;
  int64_t rows;
  at::Tensor bias;
};
LinearCall linear_call(const char* name, const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias, int64_t out_features, bool float_weights = false);

// linear_avx512.cpp
bool has_bf16_linear();
bool has_amx_linear();
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t out_features);
at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        int64_t out_features);

// linear_avx2.cpp
bool has_avx2_linear();
at::Tensor linear_avx2(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features);

// sampling.cpp
at::Tensor nucleus_draw(const at::Tensor& logits, const at::Tensor& settings, const at::Tensor& uniform, int64_t cap);

}  // namespace flare_native
