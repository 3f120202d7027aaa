// attention_avx2: flare::paged_attention on AVX2+FMA for every query row of a step (prompt chunks,
// drafts under verification and decode rows alike), fp32 or bfloat16 queries over an fp32 or
// bfloat16 paged cache read in place, GQA, sliding windows and soft-capping.
//
// Work comes in blocks of up to 6 query rows (a row: one query token x one query head) that share a
// sequence and a kv head: a decode row's group of query heads, or consecutive (token, head) rows of
// a chunk. A block walks its keys in 64-key tiles at absolute positions (multiples of 64) with an
// online softmax in fp32:
//   scores  each (row, key) a dot product over the head features, 8 features per lane, summed in
//           feature order and then across lanes in one fixed tree (reduce4); 6 rows x 2 keys of
//           accumulators, each key's features loaded (bfloat16 widened in registers) once per block;
//   softmax per row, over the keys of the tile it sees (causal, window): running max and sum;
//   values  6 rows x 16 features of accumulators, keys in order, each value loaded once per block.
// Every step of a row's arithmetic depends only on that row (its query, its position, its keys),
// never on which rows share its block or its step: a row gets the same bits decoded alone, beside
// other rows, or inside a prompt chunk of any length (docs/serving.md, "Reproducibility"). A tile a
// row sees none of leaves it untouched; keys of a tile outside a row's range weigh exactly 0.
//
// The functions carry target("avx2,fma") and the file is compiled without AVX-512 (native/__init__.py),
// so an AVX-512 host runs (and tests) the code an AVX2 host runs; avx2_attention_supported asks the
// CPU at run time.
#include <atomic>

#include "avx2.h"

namespace flare_native {

#if defined(FLARE_X86)
namespace {

constexpr int kRowsMax = 6;  // query rows per block

FLARE_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
FLARE_AVX2 inline __m256 load8(const uint16_t* p) {  // 8 bfloat16 -> fp32, exactly
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

FLARE_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
FLARE_AVX2 inline void store8(uint16_t* p, __m256 v) {  // nearest even, NaN -> 0x7FC0 (as torch)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m128i packed = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// tanh on 8 lanes: a rational approximation odd in x (relative error under 5e-7), 1 in magnitude
// where fp32's tanh is.
FLARE_AVX2 inline __m256 tanh8(__m256 x) {
  const __m256 bound = _mm256_set1_ps(7.90531110763549805f);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), bound)), bound);
  const __m256 x2 = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(-2.76076847742355e-16f);
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.00018790482477e-13f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-8.60467152213735e-11f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(5.12229709037114e-08f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(1.48572235717979e-05f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(6.37261928875436e-04f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(4.89352455891786e-03f));
  __m256 q = _mm256_set1_ps(1.19825839466702e-06f);
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(1.18534705686654e-04f));
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(2.26843463243900e-03f));
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(4.89352518554385e-03f));
  return _mm256_div_ps(_mm256_mul_ps(x, p), q);
}

// The lane sums of four accumulators: lane j of the result is ((a0 + a1) + (a2 + a3)) + ((a4 + a5) +
// (a6 + a7)) of the j-th argument, whichever the other three are.
FLARE_AVX2 inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

FLARE_AVX2 inline float sum8(__m256 v) {  // ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

FLARE_AVX2 inline float max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// scores[r * kTile + c + k] = q[r] . key[c + k] for MR rows x NK keys.
template <int MR, int NK, typename C>
FLARE_AVX2 inline void qk(const float* q, int64_t dim, const C* const* keys, int64_t c, float* scores) {
  __m256 acc[MR * NK];
  for (int k = 0; k < NK; ++k) {
    const __m256 kv = load8(keys[c + k]);
    for (int r = 0; r < MR; ++r) acc[r * NK + k] = _mm256_mul_ps(_mm256_loadu_ps(q + r * dim), kv);
  }
  for (int64_t d = 8; d < dim; d += 8) {
    __m256 kv[NK];
    for (int k = 0; k < NK; ++k) kv[k] = load8(keys[c + k] + d);
    for (int r = 0; r < MR; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * dim + d);
      for (int k = 0; k < NK; ++k) acc[r * NK + k] = _mm256_fmadd_ps(qv, kv[k], acc[r * NK + k]);
    }
  }
  const __m256 zero = _mm256_setzero_ps();
  for (int i = 0; i < MR * NK; i += 4) {
    alignas(16) float sums[4];
    _mm_store_ps(sums, reduce4(acc[i], i + 1 < MR * NK ? acc[i + 1] : zero, i + 2 < MR * NK ? acc[i + 2] : zero,
                               i + 3 < MR * NK ? acc[i + 3] : zero));
    for (int j = 0; j < 4 && i + j < MR * NK; ++j) scores[((i + j) / NK) * kTile + c + (i + j) % NK] = sums[j];
  }
}

// o[r][f0 + f] = o[r][f0 + f] * rescale[r] + sum over keys c0 <= c < c1 of probs[r][c] values[c][f0 + f],
// for MR rows x NF * 8 features.
template <int MR, int NF, typename C>
FLARE_AVX2 inline void pv(const float* probs, const C* const* values, int64_t c0, int64_t c1, int64_t f0,
                          const float* rescale, float* o, int64_t dim) {
  __m256 acc[MR][NF];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NF; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t c = c0; c < c1; ++c) {
    __m256 v[NF];
    for (int j = 0; j < NF; ++j) v[j] = load8(values[c] + f0 + 8 * j);
    for (int r = 0; r < MR; ++r) {
      const __m256 p = _mm256_broadcast_ss(probs + r * kTile + c);
      for (int j = 0; j < NF; ++j) acc[r][j] = _mm256_fmadd_ps(p, v[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NF; ++j) {
      float* dst = o + r * dim + f0 + 8 * j;
      _mm256_storeu_ps(dst, _mm256_fmadd_ps(_mm256_loadu_ps(dst), _mm256_set1_ps(rescale[r]), acc[r][j]));
    }
}

// What every block of a call shares.
template <typename Q, typename C>
struct Call {
  const Q* q;
  Q* out;
  const C* k_cache;
  const C* v_cache;
  const int32_t* tables;
  const int32_t* lens;
  int64_t heads, kv_heads, dim, page_tokens, max_blocks;
  float q_scale, softcap;
  int64_t window;
};

// Up to kRowsMax query rows (token index, query head, position) of one sequence and kv head.
struct Block {
  int64_t seq, kvh, cost;
  int rows;
  int64_t token[kRowsMax], head[kRowsMax], pos[kRowsMax];
};

struct Scratch {
  std::vector<float> q, o;
  alignas(32) float scores[kRowsMax * kTile];
  alignas(32) float probs[kRowsMax * kTile];
};

template <int MR, typename Q, typename C>
FLARE_AVX2 void attend_block(const Call<Q, C>& a, const Block& b, Scratch& s) {
  const int64_t dim = a.dim, stride = a.kv_heads * dim;
  const int64_t stop = std::min<int64_t>(a.lens[b.seq], a.max_blocks * a.page_tokens);  // keys written and mapped
  const int32_t* table = a.tables + b.seq * a.max_blocks;
  int64_t floor[MR], last[MR];
  float m[MR], l[MR], rescale[MR];
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;  // keys [lo, hi) some row sees
  for (int r = 0; r < MR; ++r) {
    floor[r] = a.window > 0 ? std::max<int64_t>(0, b.pos[r] - a.window + 1) : 0;
    last[r] = std::min<int64_t>(b.pos[r], stop - 1);
    if (last[r] >= floor[r]) {
      lo = std::min(lo, floor[r]);
      hi = std::max(hi, last[r] + 1);
    }
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
    const Q* src = a.q + (b.token[r] * a.heads + b.head[r]) * dim;
    for (int64_t d = 0; d < dim; d += 8)
      _mm256_storeu_ps(s.q.data() + r * dim + d, _mm256_mul_ps(load8(src + d), _mm256_set1_ps(a.q_scale)));
  }
  std::fill(s.o.begin(), s.o.begin() + MR * dim, 0.0f);
  const C* kbase = a.k_cache + b.kvh * dim;
  const C* vbase = a.v_cache + b.kvh * dim;
  // Keys [c0, c1) of the tile at `first` (its keys from absolute position `first`): where they lie.
  const auto map = [&](int64_t first, const C** keys, const C** values) {
    const int64_t c0 = std::max(lo, first) - first, c1 = std::min(hi, first + kTile) - first;
    int64_t page = (first + c0) / a.page_tokens, at = (first + c0) % a.page_tokens;
    for (int64_t c = c0; c < c1; ++page, at = 0) {
      const int64_t slot = static_cast<int64_t>(table[page]) * a.page_tokens + at;
      const C* key = kbase + slot * stride;
      const C* value = vbase + slot * stride;
      for (const int64_t end = std::min(c1, c + a.page_tokens - at); c < end; ++c, key += stride, value += stride) {
        keys[c] = key;
        values[c] = value;
      }
    }
  };
  const C* where[2][2][kTile];  // [this tile, the next][keys, values][key]
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  int now = 0;
  map(lo / kTile * kTile, where[now][0], where[now][1]);
  for (int64_t first = lo / kTile * kTile; first < hi; first += kTile, now ^= 1) {
    const int64_t c0 = std::max(lo, first) - first, c1 = std::min(hi, first + kTile) - first;
    const C* const* keys = where[now][0];
    const C* const* values = where[now][1];
    if (first + kTile < hi) {  // the next tile's pages are scattered: fetch them while this one computes
      const C** next_keys = where[now ^ 1][0];
      const C** next_values = where[now ^ 1][1];
      map(first + kTile, next_keys, next_values);
      const int64_t n1 = std::min(hi, first + 2 * kTile) - first - kTile;
      for (int64_t c = 0; c < n1; ++c)
        for (int64_t byte = 0; byte < dim * static_cast<int64_t>(sizeof(C)); byte += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(next_keys[c]) + byte, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(next_values[c]) + byte, _MM_HINT_T0);
        }
    }
    int64_t c = c0;
    for (; c + 2 <= c1; c += 2) qk<MR, 2>(s.q.data(), dim, keys, c, s.scores);
    if (c < c1) qk<MR, 1>(s.q.data(), dim, keys, c, s.scores);
    for (int r = 0; r < MR; ++r) {
      float* pr = s.probs + r * kTile;
      const int64_t va = std::max(floor[r], first) - first, vb = std::min(last[r], first + kTile - 1) - first;
      if (vb < va) {  // sees none of this tile: untouched
        std::fill(pr + c0, pr + c1, 0.0f);
        rescale[r] = 1.0f;
        continue;
      }
      const __m256 from = _mm256_set1_ps(static_cast<float>(va)), to = _mm256_set1_ps(static_cast<float>(vb));
      __m256 v[kTile / 8], keep[kTile / 8];
      __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      for (int i = 0; i < kTile / 8; ++i) {
        const __m256 index = _mm256_add_ps(lane, _mm256_set1_ps(8.0f * i));
        keep[i] = _mm256_and_ps(_mm256_cmp_ps(index, from, _CMP_GE_OQ), _mm256_cmp_ps(index, to, _CMP_LE_OQ));
        v[i] = _mm256_load_ps(s.scores + r * kTile + 8 * i);
        if (a.softcap > 0.0f) v[i] = _mm256_mul_ps(_mm256_set1_ps(a.softcap), tanh8(v[i]));
        top = _mm256_max_ps(top, _mm256_blendv_ps(top, v[i], keep[i]));
      }
      const float next = std::max(m[r], max8(top));
      const bool first_seen = m[r] == -std::numeric_limits<float>::infinity();
      rescale[r] = first_seen ? 0.0f : _mm256_cvtss_f32(exp8(_mm256_set1_ps(m[r] - next)));
      __m256 p[kTile / 8];
      for (int i = 0; i < kTile / 8; ++i) {
        p[i] = _mm256_and_ps(exp8(_mm256_sub_ps(v[i], _mm256_set1_ps(next))), keep[i]);
        _mm256_store_ps(pr + 8 * i, p[i]);
      }
      const __m256 total = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3])),
                                         _mm256_add_ps(_mm256_add_ps(p[4], p[5]), _mm256_add_ps(p[6], p[7])));
      l[r] = l[r] * rescale[r] + sum8(total);
      m[r] = next;
    }
    int64_t f = 0;
    for (; f + 16 <= dim; f += 16) pv<MR, 2>(s.probs, values, c0, c1, f, rescale, s.o.data(), dim);
    if (f < dim) pv<MR, 1>(s.probs, values, c0, c1, f, rescale, s.o.data(), dim);
  }
  for (int r = 0; r < MR; ++r) {
    const __m256 inv = _mm256_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
    Q* dst = a.out + (b.token[r] * a.heads + b.head[r]) * dim;
    for (int64_t d = 0; d < dim; d += 8) store8(dst + d, _mm256_mul_ps(_mm256_loadu_ps(s.o.data() + r * dim + d), inv));
  }
}

template <typename Q, typename C>
FLARE_AVX2 void run_block(const Call<Q, C>& a, const Block& b, Scratch& s) {
  switch (b.rows) {
    case 6: return attend_block<6>(a, b, s);
    case 5: return attend_block<5>(a, b, s);
    case 4: return attend_block<4>(a, b, s);
    case 3: return attend_block<3>(a, b, s);
    case 2: return attend_block<2>(a, b, s);
    default: return attend_block<1>(a, b, s);
  }
}

// The blocks of a step: per sequence and kv head, its (token, query head) rows in order, 6 at a
// time. Threads take the next block as they finish: kv head by kv head (a long prompt's keys and
// values of one kv head stay in a core's cache), heaviest first within each, so they end together.
std::vector<Block> plan_blocks(const int32_t* starts, int64_t seqs, const int64_t* positions, int64_t kv_heads,
                               int64_t group, int64_t window) {
  std::vector<Block> blocks;
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t rows = (starts[i + 1] - starts[i]) * group;  // (token, head) rows per kv head
    const int64_t count = (rows + kRowsMax - 1) / kRowsMax;   // blocks as even as they go: 8 rows as 4 + 4
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
      for (int64_t k = 0, row = 0; k < count; ++k) {
        Block b{i, kvh, 0, static_cast<int>(rows / count + (k < rows % count ? 1 : 0)), {}, {}, {}};
        for (int r = 0; r < b.rows; ++r, ++row) {
          const int64_t t = starts[i] + row / group;
          b.token[r] = t;
          b.head[r] = kvh * group + row % group;
          b.pos[r] = positions[t];
          b.cost = std::max(b.cost, window > 0 ? std::min(window, positions[t] + 1) : positions[t] + 1);
        }
        blocks.push_back(b);
      }
  }
  std::stable_sort(blocks.begin(), blocks.end(),
                   [](const Block& x, const Block& y) {
                     return x.kvh != y.kvh ? x.kvh < y.kvh : x.cost * x.rows > y.cost * y.rows;
                   });
  return blocks;
}

template <typename Q, typename C>
void attend_all(const Call<Q, C>& a, const std::vector<Block>& blocks) {
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(blocks.size());
  at::parallel_for(0, std::min<int64_t>(count, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch s;
    s.q.resize(kRowsMax * a.dim);
    s.o.resize(kRowsMax * a.dim);
    for (int64_t i = next++; i < count; i = next++) run_block(a, blocks[i], s);
  });
}

}  // namespace
#endif

bool avx2_attention_supported(const at::Tensor& q, const at::Tensor& k_cache) {
#if defined(FLARE_X86)
  const auto supported = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; };
  return has_avx2_linear() && supported(q.scalar_type()) && supported(k_cache.scalar_type()) && q.size(2) % 8 == 0;
#else
  return false;
#endif
}

// flare::paged_attention's arguments (checked by the caller: in-place layout, dtypes supported).
at::Tensor avx2_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                          const at::Tensor& positions, double scale, int64_t window, double softcap) {
#if defined(FLARE_X86)
  const at::Tensor qc = q.contiguous(), tables = block_tables.contiguous();
  const int64_t seqs = seq_lens.numel(), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(2);
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  at::Tensor out = starts[seqs] < q.size(0) ? at::zeros_like(qc) : at::empty_like(qc);
  const std::vector<Block> blocks =
      plan_blocks(starts, seqs, positions.data_ptr<int64_t>(), kv_heads, heads / kv_heads, window);
  const float q_scale = static_cast<float>(softcap > 0.0 ? scale / softcap : scale);
  const auto run = [&](auto q_type, auto c_type) {
    using Q = decltype(q_type);
    using C = decltype(c_type);
    const Call<Q, C> call{reinterpret_cast<const Q*>(qc.data_ptr()),
                          reinterpret_cast<Q*>(out.data_ptr()),
                          reinterpret_cast<const C*>(k_cache.data_ptr()),
                          reinterpret_cast<const C*>(v_cache.data_ptr()),
                          tables.data_ptr<int32_t>(),
                          seq_lens.data_ptr<int32_t>(),
                          heads,
                          kv_heads,
                          dim,
                          k_cache.size(1),
                          tables.size(1),
                          q_scale,
                          static_cast<float>(softcap > 0.0 ? softcap : 0.0),
                          window};
    attend_all(call, blocks);
  };
  const bool q16 = qc.scalar_type() == at::kBFloat16, c16 = k_cache.scalar_type() == at::kBFloat16;
  if (q16 && c16) run(uint16_t{}, uint16_t{});
  else if (q16) run(uint16_t{}, float{});
  else if (c16) run(float{}, uint16_t{});
  else run(float{}, float{});
  return out;
#else
  TORCH_CHECK(false, "avx2_attention: not an x86-64 build");
#endif
}

}  // namespace flare_native
