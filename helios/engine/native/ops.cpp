// The op schemas of the library, and the CPU kernels it serves for the flare:: ops.
#include <torch/library.h>

#include <numeric>

#include "common.h"

namespace flare_native {

// ------------------------------------------------------------------- the flare:: ops' CPU kernels
// The compiled step calls flare::paged_attention and flare::write_kv through the dispatcher once per
// layer. Served from C++, a decode step never takes the GIL (the HTTP thread keeps streaming while
// it runs); the steps these kernels do not cover go to the Python kernels, which helios registers
// as flare_fallback:: (helios/engine/kernels.py) and which compute the same rows the same way.

namespace {

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

// Whether the native kernels can attend this layout where it lies (else the Python kernels do).
bool in_place(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
              const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const at::Tensor& positions) {
  return q.dim() == 3 && k_cache.dim() == 4 && k_cache.size(3) <= kMaxDim && q.size(2) == k_cache.size(3) &&
         k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type() &&
         k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.scalar_type() == at::kInt &&
         block_tables.dim() == 2 && query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
         seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && positions.scalar_type() == at::kLong &&
         positions.is_contiguous() && query_start_loc.numel() == seq_lens.numel() + 1 &&
         q.size(1) % k_cache.size(2) == 0;
}

at::Tensor index_of(const std::vector<int64_t>& values) {
  return at::from_blob(const_cast<int64_t*>(values.data()), {static_cast<int64_t>(values.size())}, at::kLong).clone();
}

}  // namespace

// Which arithmetic attends a layer's rows depends only on the layer (dtype, head size, soft-capping),
// never on the step's shape, so a query row gets the same bits whatever it shares the step with:
// * tiled (bfloat16, head size a multiple of 64 up to 256, no soft-capping, AVX512-BF16): decode
//   rows and chunks of up to kInPlaceRows rows run tiles_in_place where their pages lie, longer
//   chunks chunk_attention over their gathered pages, all on chunk_rows with 64-key tiles aligned
//   to absolute key positions;
// * else on AVX2+FMA (fp32 or bfloat16 queries and cache, head size a multiple of 8): every row,
//   of a chunk or a decode, on avx2_attention in place, in blocks of rows sharing a kv head;
// * otherwise every query row, of a chunk or a decode, is a decode_attention row of its sequence.
// Layouts none covers go to the Python kernels whole.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, const at::Tensor& positions, double scale,
                           int64_t window, double softcap) {
  if (!in_place(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions))
    return attention_fallback(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window,
                              softcap);
  const bool tiled = chunk_attention_supported(q, k_cache) && softcap <= 0.0;
  if (!tiled && avx2_attention_supported(q, k_cache))
    return avx2_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window,
                          softcap);
  const int64_t seqs = seq_lens.numel();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  // The output, contiguous whatever q's strides; rows past the last sequence's are padding, zeros.
  const auto blank = [&] {
    return starts[seqs] < q.size(0) ? at::zeros(q.sizes(), q.options()) : at::empty(q.sizes(), q.options());
  };
  if (!tiled) {  // every row one by one, a decode_attention row of its sequence
    bool one_each = seqs == q.size(0);  // row i is sequence i's
    for (int64_t i = 0; i <= seqs && one_each; ++i) one_each = starts[i] == i;
    if (one_each)
      return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, positions, scale, window, softcap);
    std::vector<int64_t> picked, rows;
    for (int64_t i = 0; i < seqs; ++i)
      for (int64_t r = starts[i]; r < starts[i + 1]; ++r) {
        picked.push_back(i);
        rows.push_back(r);
      }
    at::Tensor out = blank();
    if (!rows.empty()) {
      const at::Tensor seq_index = index_of(picked), row_index = index_of(rows);
      const at::Tensor attended = decode_attention(
          q.index_select(0, row_index).contiguous(), k_cache, v_cache, block_tables.index_select(0, seq_index),
          seq_lens.index_select(0, seq_index), positions.index_select(0, row_index).contiguous(), scale, window,
          softcap);
      out.index_copy_(0, row_index, attended);
    }
    return out;
  }
  at::Tensor out = blank();
  // Decode rows and short chunks where their pages lie, in one pass; longer chunks over their
  // gathered pages, many tasks to each.
  std::vector<int64_t> near, chunks;
  for (int64_t i = 0; i < seqs; ++i) {
    const int32_t len = starts[i + 1] - starts[i];
    if (len > kInPlaceRows)
      chunks.push_back(i);
    else if (len > 0)
      near.push_back(i);
  }
  if (!near.empty())
    tiles_in_place(q.contiguous(), k_cache, v_cache, block_tables.contiguous(), seq_lens, query_start_loc, positions,
                   near, scale, window, out);
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

// flare_native::avx2_attention: the AVX2 kernel whatever the layer would get (its tests run it on
// AVX-512 hosts too), on the layouts paged_attention serves in place.
at::Tensor avx2_attention_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, const at::Tensor& positions, double scale,
                             int64_t window, double softcap) {
  TORCH_CHECK(in_place(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions) &&
                  avx2_attention_supported(q, k_cache),
              "avx2_attention: needs AVX2 and FMA, fp32 or bfloat16 queries and caches, a head size that is a multiple "
              "of 8, contiguous caches and int32 tables, lengths and query starts");
  return avx2_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window,
                        softcap);
}

void write_kv_op(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& slot_mapping) {
  if (k_cache.is_contiguous() && v_cache.is_contiguous()) return write_kv(k_cache, v_cache, k, v, slot_mapping);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flare_fallback::write_kv", "")
                             .typed<void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  op.call(k_cache, v_cache, k, v, slot_mapping);
}

}  // namespace flare_native

using namespace flare_native;

TORCH_LIBRARY(flare_native, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor kv_lens, "
        "Tensor positions, float scale, int window, float softcap) -> Tensor");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def("has_bf16_linear() -> bool", &has_bf16_linear);
  m.def("has_amx_linear() -> bool", &has_amx_linear);
  m.def("has_avx2_linear() -> bool", &has_avx2_linear);
  m.def("pack_linear(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_tiles(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_avx2(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("chunk_attention(Tensor q, Tensor keys, Tensor values, Tensor positions, int key0, float scale, int window) -> Tensor");
  m.def("avx2_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, Tensor positions, float scale, int window, float softcap) -> Tensor");
  m.def("has_avx2_attention(Tensor q, Tensor k_cache) -> bool", &avx2_attention_supported);
  m.def("nucleus_draw(Tensor logits, Tensor settings, Tensor uniform, int cap) -> Tensor");
  m.def("keep_packed(Tensor k_cache, Tensor v_cache) -> bool", &keep_packed);
  m.def("forget_packed(Tensor k_cache, Tensor pages) -> ()", &forget_packed);
}

TORCH_LIBRARY_IMPL(flare_native, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("write_kv", &write_kv);
  m.impl("pack_linear", &pack_linear);
  m.impl("linear", &linear);
  m.impl("linear_tiles", &linear_tiles);
  m.impl("linear_avx2", &linear_avx2);
  m.impl("chunk_attention", &chunk_attention);
  m.impl("avx2_attention", &avx2_attention_op);
  m.impl("nucleus_draw", &nucleus_draw);
}

TORCH_LIBRARY_IMPL(flare_native, Meta, m) {
  m.impl("linear", &linear_meta);
  m.impl("linear_tiles", &linear_meta);
  m.impl("linear_avx2", &linear_meta);
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
