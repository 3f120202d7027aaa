// topk_rows: the k largest entries of each row of a float32 matrix and their indices, what a step
// program's top-logprob outputs take (ignition/models/heads.py: torch.topk(logits, k, -1)). torch's
// CPU topk copies every row into a vector of (value, index) pairs and partially sorts it: about 60 us
// for one 49,152-entry row, on one thread per row. Here one pass per row keeps the k best so far,
// sorted, and compares 8 entries at a time with the k-th (AVX2), inserting the few that beat it:
// a few microseconds a row.
//
// The values are torch.topk's, in descending order; among equal values the lower index comes
// first (torch leaves that order unspecified), and NaN ranks above every number, as torch ranks it.
// A row's result depends only on that row; rows are split over threads whole.
#include <torch/library.h>

#include "avx2.h"

namespace flare_native {
namespace {

// Whether entry (v, i) ranks above (w, j), with i > j (later entries never win a tie).
inline bool beats(float v, float w) { return v > w || (v != v && w == w); }

struct Best {
  float* values;  // [k], descending
  int64_t* ids;
  int64_t k, held = 0;

  // Offer entry i (later than every entry held), inserting it in order where it ranks.
  void offer(float v, int64_t i) {
    if (held == k && !beats(v, values[k - 1])) return;
    int64_t at = held < k ? held++ : k - 1;
    for (; at > 0 && beats(v, values[at - 1]); --at) {
      values[at] = values[at - 1];
      ids[at] = ids[at - 1];
    }
    values[at] = v;
    ids[at] = i;
  }
};

void row_portable(const float* x, int64_t n, Best& best) {
  for (int64_t i = 0; i < n; ++i) best.offer(x[i], i);
}

#if defined(FLARE_X86)
// Entries 8 at a time once k are held: a lane is looked at only where it may beat the k-th
// (greater, or NaN: offer decides), which after the first few hundred entries is rare.
FLARE_AVX2 void row_avx2(const float* x, int64_t n, Best& best) {
  int64_t i = 0;
  for (; i < n && best.held < best.k; ++i) best.offer(x[i], i);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i), kth = _mm256_set1_ps(best.values[best.k - 1]);
    const int mask = _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v, kth, _CMP_GT_OQ), _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    for (int bits = mask; bits != 0; bits &= bits - 1) {
      const int lane = __builtin_ctz(bits);
      best.offer(x[i + lane], i + lane);
    }
  }
  for (; i < n; ++i) best.offer(x[i], i);
}
#endif

}  // namespace

std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "topk_rows: needs float32 rows [R, V] on the CPU");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(k >= 1 && k <= n, "topk_rows: k must lie in 1..", n, ", not ", k);
  const at::Tensor rows_in = x.contiguous();
  at::Tensor values = at::empty({rows, k}, x.options()), ids = at::empty({rows, k}, x.options().dtype(at::kLong));
  const float* xp = rows_in.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
#if defined(FLARE_X86)
  static const bool avx2 = __builtin_cpu_supports("avx2");
#endif
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      Best best{vp + r * k, ip + r * k, k};
#if defined(FLARE_X86)
      if (avx2) {
        row_avx2(xp + r * n, n, best);
        continue;
      }
#endif
      row_portable(xp + r * n, n, best);
    }
  });
  return {values, ids};
}

std::tuple<at::Tensor, at::Tensor> topk_rows_meta(const at::Tensor& x, int64_t k) {
  std::vector<c10::SymInt> shape{x.sym_size(0), c10::SymInt(k)};
  return {at::empty_symint(shape, x.options()), at::empty_symint(shape, x.options().dtype(at::kLong))};
}

}  // namespace flare_native

TORCH_LIBRARY_FRAGMENT(flare_native, m) { m.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)"); }
TORCH_LIBRARY_IMPL(flare_native, CPU, m) { m.impl("topk_rows", &flare_native::topk_rows); }
TORCH_LIBRARY_IMPL(flare_native, Meta, m) { m.impl("topk_rows", &flare_native::topk_rows_meta); }
