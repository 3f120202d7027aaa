// nucleus_draw: the sampler's whole draw for temperature + top-p (+ min-p) rows in one call, where
// the torch path takes about thirty operations (sampler.py: _candidate_draw and draw).
//
// For row r, with scaled logits s = logits[r] / temperature[r] and m = max(s), two passes over the
// row give
//   lse       = m + log(sum exp(max(s - m, -87)))   (the sampler's logsumexp rule: terms below
//               e^-87 count as e^-87, far below the sum's resolution), and
//   the candidates: every s_i with s_i - m >= log(1 / cap), descending (ties: lower id first).
// A token of probability at least 1 / cap is always a candidate (its s_i - m >= s_i - lse >=
// log(1 / cap)), and the candidates are a prefix of the row's tokens ordered by probability, so
// when their mass reaches top_p the nucleus lies among them and the draw over them is the draw
// over the whole vocabulary. Where more than `cap` tokens qualify (a flat row), a NaN poisons the
// row, or the candidates hold less than top_p, the row's id is -1 and the torch path draws it.
//
// A row's result depends only on that row and its uniform: rows are split over threads whole, each
// row's sums are taken in one fixed order.
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

// One row's candidates (descending; ties: lower id first) and its logsumexp at temperature t;
// false where the row takes the torch path (more than `cap` candidates, no finite maximum or sum).
bool row_candidates(const float* row, int64_t vocab, float t, int64_t cap, std::vector<std::pair<float, int64_t>>& keep,
                    float& lse) {
  const float gap = std::log(1.0f / static_cast<float>(cap));
  const RowSums sums = row_sums(row, vocab, t, gap, keep);
  if (static_cast<int64_t>(keep.size()) > cap || !std::isfinite(sums.max) || !std::isfinite(sums.sum)) return false;
  lse = sums.max + std::log(sums.sum);
  std::sort(keep.begin(), keep.end(),
            [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
  return true;
}

// The sampler's candidate draw (sampler.py: _candidate_draw then draw) over one row's candidates:
// top-p against the whole vocabulary's logsumexp (a candidate stays while the mass before it is
// below top_p; the first always), min-p against the likeliest survivor, then the inverse-CDF pick
// of u times the survivors' total weight exp(s - max) (float64 running sums of the float32
// weights; a weight below e^-87 is 0). -1 where the candidates hold less than top_p (the torch
// path takes the row).
int64_t candidate_draw(const std::vector<std::pair<float, int64_t>>& keep, float lse, float top_p, float min_p,
                       double u) {
  const int64_t n = static_cast<int64_t>(keep.size());
  std::vector<float> probs(n);
  float mass = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    probs[j] = std::exp(keep[j].first - lse);
    mass += probs[j];
  }
  if (n == 0 || !(mass >= top_p)) return -1;
  std::vector<float> v(n);
  double cumulative = 0.0;  // torch's float32 cumsum: a float64 running sum, each prefix rounded to float32
  for (int64_t j = 0; j < n; ++j) {
    cumulative += probs[j];
    const bool kept = j == 0 || static_cast<float>(cumulative) - probs[j] < top_p;
    v[j] = kept ? keep[j].first : -std::numeric_limits<float>::infinity();
  }
  const float top = v[0];
  std::vector<float> w(n);  // the survivors' weights exp(s - max); 0 for the dropped
  for (int64_t j = 0; j < n; ++j) w[j] = std::exp(v[j] - top);
  if (min_p > 0.0f) {  // softmax over the survivors; drop those below min_p times the likeliest
    float total = 0.0f;
    for (int64_t j = 0; j < n; ++j) total += w[j];
    const float threshold = min_p * (1.0f / total);
    for (int64_t j = 0; j < n; ++j)
      if (w[j] / total < threshold) w[j] = 0.0f;
  }
  std::vector<double> inner(n);
  double running = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    running += v[j] - top < kExpFloor ? 0.0 : static_cast<double>(w[j]);
    inner[j] = running;
  }
  // Stay below the total, so the pick is a token with weight.
  const double rest = std::min(std::max(u * running, 0.0), running * (1.0 - std::ldexp(1.0, -50)));
  const int64_t at = std::upper_bound(inner.begin(), inner.end(), rest) - inner.begin();
  return keep[std::min(at, n - 1)].second;
}

}  // namespace

at::Tensor nucleus_draw(const at::Tensor& logits, const at::Tensor& settings, const at::Tensor& uniform, int64_t cap) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "nucleus_draw: logits must be [B, V] fp32");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(settings.dim() == 2 && settings.size(0) == rows && settings.size(1) == 3 &&
                  settings.scalar_type() == at::kFloat,
              "nucleus_draw: settings must be [B, 3] fp32 (temperature, top_p, min_p per row)");
  TORCH_CHECK(uniform.dim() == 1 && uniform.size(0) == rows && uniform.scalar_type() == at::kDouble,
              "nucleus_draw: one float64 uniform per row");
  TORCH_CHECK(cap > 0, "nucleus_draw: cap must be positive");
  const at::Tensor x = logits.contiguous(), knobs = settings.contiguous(), us = uniform.contiguous();
  at::Tensor ids = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const float* kp = knobs.data_ptr<float>();
  const double* up = us.data_ptr<double>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<std::pair<float, int64_t>> keep;
    for (int64_t r = r0; r < r1; ++r) {
      keep.clear();
      float lse = 0.0f;
      const float* k = kp + 3 * r;
      ip[r] = row_candidates(xp + r * vocab, vocab, k[0], cap, keep, lse) ? candidate_draw(keep, lse, k[1], k[2], up[r])
                                                                         : -1;
    }
  });
  return ids;
}

}  // namespace flare_native
