// decode_attention attends one query token per sequence over that sequence's pages in place: no
// gather of the history into a padded copy, no mask tensor. Each (sequence, kv head) task loads the
// group of query heads sharing that kv head once and streams its keys and values page by page with
// an online softmax in fp32, whatever the cache dtype (bfloat16 widened as it is read: the loops
// vectorize on whatever -march the library is built for, AVX2 included). Every row is computed on
// its own, so a row's result does not depend on which other rows share the step. write_kv stores a
// step's keys and values into their slots.
#include "common.h"

namespace flare_native {
namespace {

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

}  // namespace

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
  forget_pages(k_cache, sp, slots.numel(), k_cache.size(1));  // their packed copies (packed_pages.cpp) are stale
}

}  // namespace flare_native
