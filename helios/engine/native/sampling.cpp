// nucleus_candidates: the sampler's full-vocabulary work for temperature + top-p rows in two passes
// over each row, where the torch path takes about eight (divide, max, subtract, clamp, exp, sum,
// log, then a partial sort for the 128 likeliest tokens).
//
// For row r, with scaled logits s = logits[r] / temperature[r] and m = max(s):
//   lse[r]    = m + log(sum exp(max(s - m, -87)))   (the sampler's logsumexp rule: terms below
//               e^-87 count as e^-87, far below the sum's resolution);
//   values[r] = every s_i with s_i - m >= log(1 / cap), descending (ties: lower id first), padded
//               with -inf to the widest row; ids[r] their token ids (padding: 0);
//   counts[r] = how many there are, or -1 where more than `cap` tokens (or a NaN) qualify: that row
//               takes the torch path.
// A token of probability at least 1 / cap always qualifies (its s_i - m >= s_i - lse >=
// log(1 / cap)), and the candidates are a prefix of the row's tokens ordered by probability, so
// when their mass reaches top_p the nucleus lies among them (helios/engine/sampler.py).
//
// A row's results depend only on that row: rows are split over threads whole, each row's sum is
// taken in one fixed order.
#include "avx2.h"

namespace flare_native {
namespace {

constexpr float kExpFloor = -87.0f;

// One row's two passes: the max of s = x / t, then the sum of exp(max(s - m, -87)) (8 lanes in a
// fixed order, then the tail in order) with every s - m >= gap collected as (s, id). Returns the
// max (NaN where some s is NaN: the caller leaves such a row to the torch path) and the sum.
struct RowSums {
  float max, sum;
};

// Features [i, n) one by one (the lanes' leftover, or a whole row): the max of s_i (NaN where one is),
// or, with max m given, total plus each exp term in order, collecting candidates.
float max_of(const float* x, int64_t i, int64_t n, float t, float m) {
  bool nan = false;
  for (; i < n; ++i) {
    const float s = x[i] / t;
    nan |= s != s;
    m = std::max(m, s);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

float sum_of(const float* x, int64_t i, int64_t n, float t, float m, float gap, float total,
             std::vector<std::pair<float, int64_t>>& keep) {
  for (; i < n; ++i) {
    const float d = x[i] / t - m;
    total += exp_nonpositive(std::max(d, kExpFloor));
    if (d >= gap) keep.emplace_back(x[i] / t, i);
  }
  return total;
}

RowSums row_portable(const float* x, int64_t n, float t, float gap, std::vector<std::pair<float, int64_t>>& keep) {
  const float m = max_of(x, 0, n, t, -std::numeric_limits<float>::infinity());
  if (m != m) return {m, 0.0f};
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] = sum_of(x, i + l, i + l + 1, t, m, gap, lanes[l], keep);
  float total = 0.0f;
  for (int l = 0; l < 8; ++l) total += lanes[l];
  return {m, sum_of(x, i, n, t, m, gap, total, keep)};
}

#if defined(FLARE_X86)
// row_portable's results on AVX2 (the same lanes, products and order of the sum; exp8's lanes
// may differ from exp_nonpositive's in the last bit).
FLARE_AVX2 RowSums row_avx2(const float* x, int64_t n, float t, float gap,
                            std::vector<std::pair<float, int64_t>>& keep) {
  const __m256 tv = _mm256_set1_ps(t);
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 s = _mm256_div_ps(_mm256_loadu_ps(x + i), tv);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(s, s, _CMP_UNORD_Q));
    mv = _mm256_max_ps(mv, s);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  float m = lanes[0];
  for (int l = 1; l < 8; ++l) m = std::max(m, lanes[l]);
  m = _mm256_movemask_ps(unordered) != 0 ? std::numeric_limits<float>::quiet_NaN() : max_of(x, i, n, t, m);
  if (m != m) return {m, 0.0f};
  const __m256 mb = _mm256_set1_ps(m), gb = _mm256_set1_ps(gap);
  __m256 acc = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 s = _mm256_div_ps(_mm256_loadu_ps(x + i), tv);
    const __m256 d = _mm256_sub_ps(s, mb);
    acc = _mm256_add_ps(acc, exp8(d));
    int hits = _mm256_movemask_ps(_mm256_cmp_ps(d, gb, _CMP_GE_OQ));
    while (hits != 0) {
      const int l = __builtin_ctz(hits);
      hits &= hits - 1;
      keep.emplace_back(x[i + l] / t, i + l);
    }
  }
  _mm256_store_ps(lanes, acc);
  float total = 0.0f;
  for (int l = 0; l < 8; ++l) total += lanes[l];
  return {m, sum_of(x, i, n, t, m, gap, total, keep)};
}
#endif

RowSums row_sums(const float* x, int64_t n, float t, float gap, std::vector<std::pair<float, int64_t>>& keep) {
#if defined(FLARE_X86)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return row_avx2(x, n, t, gap, keep);
#endif
  return row_portable(x, n, t, gap, keep);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> nucleus_candidates(const at::Tensor& logits,
                                                                               const at::Tensor& temperature,
                                                                               int64_t cap) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "nucleus_candidates: logits must be [B, V] fp32");
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == logits.size(0) && temperature.scalar_type() == at::kFloat,
              "nucleus_candidates: one fp32 temperature per row");
  TORCH_CHECK(cap > 0, "nucleus_candidates: cap must be positive");
  const at::Tensor x = logits.contiguous(), temps = temperature.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  at::Tensor lse = at::empty({rows}, x.options());
  at::Tensor counts = at::empty({rows}, x.options().dtype(at::kLong));
  std::vector<std::vector<std::pair<float, int64_t>>> found(rows);
  const float* xp = x.data_ptr<float>();
  const float* tp = temps.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  int64_t* cp = counts.data_ptr<int64_t>();
  const float gap = std::log(1.0f / static_cast<float>(cap));
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * vocab;
      const float t = tp[r];
      auto& keep = found[r];
      const RowSums sums = row_sums(row, vocab, t, gap, keep);
      // Too many candidates (a flat row), or no finite maximum (a NaN poisons the max and the sum):
      // the torch path.
      if (static_cast<int64_t>(keep.size()) > cap || !std::isfinite(sums.max) || !std::isfinite(sums.sum)) {
        keep.clear();
        lp[r] = std::numeric_limits<float>::quiet_NaN();
        cp[r] = -1;
        continue;
      }
      lp[r] = sums.max + std::log(sums.sum);
      std::sort(keep.begin(), keep.end(), [](const auto& a, const auto& b) {
        return a.first != b.first ? a.first > b.first : a.second < b.second;
      });
      cp[r] = static_cast<int64_t>(keep.size());
    }
  });
  int64_t width = 1;
  for (const auto& keep : found) width = std::max<int64_t>(width, static_cast<int64_t>(keep.size()));
  at::Tensor values = at::full({rows, width}, -std::numeric_limits<float>::infinity(), x.options());
  at::Tensor ids = at::zeros({rows, width}, x.options().dtype(at::kLong));
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (size_t j = 0; j < found[r].size(); ++j) {
      vp[r * width + j] = found[r][j].first;
      ip[r * width + j] = found[r][j].second;
    }
  return {lse, values, ids, counts};
}

}  // namespace flare_native
