// One chunk of a sequence's queries (a prompt chunk, or drafts under verification) over its keys,
// bfloat16 throughout, on the same register micro-kernel as linear: keys and values are packed
// per kv head in 16-key blocks (keys: pairs of head features x 16 keys; values: pairs of keys x 16
// features), four to a 64-key tile, then each task takes up to 6 query rows of one head through the
// tiles in order with an online softmax in fp32 (probabilities rounded to bfloat16 for the value
// product, as SDPA's bfloat16 kernel does). Tiles no row of a task can see are skipped, and a tile
// contributes exactly nothing to a row that sees none of it, so a row's result depends only on its
// own position and the keys: it is the same whichever chunk or neighbours it comes with, and
// whether its blocks were packed for this step or kept from an earlier one (packed_pages.cpp).
#include "avx512_bf16.h"

namespace flare_native {

bool chunk_attention_supported(const at::Tensor& q, const at::Tensor& k_cache) {
#if defined(__AVX512BF16__)
  return q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && q.size(2) % 64 == 0 &&
         q.size(2) <= 256;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
namespace {

// 16 x 16 32-bit elements: r[i] lane j -> r[j] lane i (in 128-bit lanes, then across them).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + c], 128-bit lane L: rows 4g..4g+3 of column 4L + c
  __m512i u[16];
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // a 4 x 4 transpose of 128-bit lanes for each c
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// One 16-key block of one kv head: key c's features at keys[c] (nullptr: past the end, zeros).
// keys   -> [dim / 2 pairs][16 keys][2]
// values -> [dim / 16 feature blocks][8 key pairs][16 features][2]
// dim is a multiple of 64 (chunk_attention_supported). Keys move as 32-bit feature pairs, 16 keys
// x 16 pairs per register transpose; values interleave two keys' 16 features with one permute per
// 32 outputs.
void pack_block(const uint16_t* const* keys, const uint16_t* const* values, int64_t dim, uint16_t* kb, uint16_t* vb) {
  const int64_t pairs = dim / 2;
  for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
    __m512i r[16];
    for (int c = 0; c < 16; ++c)
      r[c] = keys[c] != nullptr ? _mm512_loadu_si512(keys[c] + 2 * p0) : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kb + (p0 + p) * kBlock * 2, r[p]);
  }
  // lane f of key pair (c, c + 1) holds (value[c][f], value[c + 1][f]).
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t c = 0; c < kBlock; c += 2) {
    const uint16_t* first = values[c];
    const uint16_t* second = values[c + 1];
    for (int64_t block = 0; block < dim / kBlock; ++block) {
      const __m256i a =
          first != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + block * kBlock)) : zero;
      const __m256i b =
          second != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + block * kBlock)) : zero;
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      _mm512_storeu_si512(vb + ((block * (kBlock / 2) + c / 2) * kBlock) * 2,
                          _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// Prefetch n bfloat16 elements into level 2, a cache line at a time.
inline void to_level2(const uint16_t* p, int64_t n) {
  for (int64_t o = 0; o < n; o += 32) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
}

// A 64-key tile: its four blocks one after another.
void pack_tile(const uint16_t* const* keys, const uint16_t* const* values, int64_t dim, uint16_t* kt, uint16_t* vt) {
  for (int64_t b = 0; b < kBlocksPerTile; ++b)
    pack_block(keys + b * kBlock, values + b * kBlock, dim, kt + b * kBlock * dim, vt + b * kBlock * dim);
}

// The value product of one tile: MR rows of 64 probabilities (bfloat16, x) times NB feature blocks
// from `fb0` of the tile's four value blocks (each at its own address), the key pairs in order:
// the same pairs in the same order as one panel of 32 key pairs.
template <int MR, int NB>
inline void values_micro(const uint16_t* x, int64_t ldx, const uint16_t* const* vb, int64_t fb0, float* out) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  constexpr int64_t kPairs = kBlock / 2, stride = kPairs * 2 * kBlock;  // elements between feature blocks
  for (int64_t b = 0; b < kBlocksPerTile; ++b) {
    const uint16_t* w = vb[b] + fb0 * stride;
    for (int64_t k = 0; k < kPairs; ++k) {
      __m512bh v[NB];
      for (int j = 0; j < NB; ++j) v[j] = (__m512bh)_mm512_loadu_si512(w + j * stride + k * 2 * kBlock);
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * ldx + 2 * (b * kPairs + k), sizeof pair);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, v[j]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + (m * NB + j) * kBlock, acc[m][j]);
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
  __m512 p = _mm512_set1_ps(kExpFraction[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpFraction[i]));
  return _mm512_scalef_ps(p, n);
}

template <int MR>
void chunk_rows(const uint16_t* q, int64_t ldq, const int64_t* where, const uint16_t* const* kb,
                const uint16_t* const* vb,
                int64_t tiles, int64_t dim, int64_t key0, int64_t held, float scale, int64_t window, float* o_acc,
                uint16_t* out, int64_t ldo) {
  constexpr int NB = 4;  // a tile's key blocks are the score product's output blocks
  static_assert(NB == kBlocksPerTile, "one key block per output block of the score product");
  const int64_t pairs = dim / 2;
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
    micro_at<MR, NB>(q, ldq, kb + t * kBlocksPerTile, pairs, scores);  // scores[r][c]: (r * 4 + c / 16) * 16 + c % 16
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
    for (int64_t base = 0; base < dim; base += NB * kBlock) {  // 64 features per product
      values_micro<MR, NB>(probs, kTile, vb + t * kBlocksPerTile, base / kBlock, part);
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

// chunk_rows for 1 to 6 rows.
void rows_through_tiles(int64_t count, const uint16_t* q, int64_t ldq, const int64_t* where,
                        const uint16_t* const* kp, const uint16_t* const* vp, int64_t tiles, int64_t dim, int64_t key0, int64_t held, float scale,
                        int64_t window, float* o_acc, uint16_t* out, int64_t ldo) {
  switch (count) {
    case 6: return chunk_rows<6>(q, ldq, where, kp, vp, tiles, dim, key0, held, scale, window, o_acc, out, ldo);
    case 5: return chunk_rows<5>(q, ldq, where, kp, vp, tiles, dim, key0, held, scale, window, o_acc, out, ldo);
    case 4: return chunk_rows<4>(q, ldq, where, kp, vp, tiles, dim, key0, held, scale, window, o_acc, out, ldo);
    case 3: return chunk_rows<3>(q, ldq, where, kp, vp, tiles, dim, key0, held, scale, window, o_acc, out, ldo);
    case 2: return chunk_rows<2>(q, ldq, where, kp, vp, tiles, dim, key0, held, scale, window, o_acc, out, ldo);
    default: return chunk_rows<1>(q, ldq, where, kp, vp, tiles, dim, key0, held, scale, window, o_acc, out, ldo);
  }
}

}  // namespace
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
  // Block i of kv head h: key and value blocks one after another, tile by tile.
  const int64_t nblocks = tiles * kBlocksPerTile;
  std::vector<const uint16_t*> kblocks(kv_heads * nblocks), vblocks(kv_heads * nblocks);
  for (int64_t i = 0; i < kv_heads * nblocks; ++i) {
    kblocks[i] = kp + i * kBlock * dim;
    vblocks[i] = vp + i * kBlock * dim;
  }
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
      const uint16_t* const* kt = kblocks.data() + kvh * nblocks;
      const uint16_t* const* vt = vblocks.data() + kvh * nblocks;
      const int64_t* w = wp + r0;
      const int64_t ld = heads * dim;
      rows_through_tiles(count, x, ld, w, kt, vt, tiles, dim, key0, held, fscale, window, acc.data(), y, ld);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "chunk_attention: this build has no AVX512-BF16 kernel");
#endif
}

// Decode rows and short chunks (drafts under verification) on chunk_attention's arithmetic, read in
// place: each (sequence, kv head) task takes that head's keys and values in 16-key blocks, in tiles
// starting at absolute multiples of 64 keys as a gathered chunk's are, and every query row sharing
// them through chunk_rows: a decode row's group of heads at once, a chunk's rows head by head. A
// block of a full page comes from the page's packed copy where the cache is kept (packed_pages.cpp;
// the first task to need it packs it there), any other block is packed from the pages for this
// task. One parallel region for the whole step, no gathered copy of the pages; tasks are taken
// longest first, in turn. A query row's result is bit-identical whether it was decoded alone,
// beside other rows, or computed inside a prompt chunk or a verification chunk of any length.
// q [rows, heads, dim] bfloat16 contiguous, caches bfloat16; the listed sequences' rows are written.
void tiles_in_place(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                    const at::Tensor& positions, const std::vector<int64_t>& seqs, double scale, int64_t window,
                    at::Tensor& out) {
#if defined(__AVX512BF16__)
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t page_tokens = k_cache.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1), table_stride = block_tables.stride(0);
  const int64_t token_stride = kv_heads * dim, block_elems = kBlock * dim, ld = heads * dim;
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && block_tables.stride(1) == 1,
              "tiles_in_place: queries, output and table rows must be contiguous");
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int64_t* where = positions.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  const int64_t tasks = static_cast<int64_t>(seqs.size()) * kv_heads;
  const std::shared_ptr<PackedPages> kept = packed_pages_of(k_cache, v_cache);
  alignas(64) static const uint16_t zeros[kBlock * 256] = {};  // a block past the keys (dim <= 256)
  // A task's rows and keys: sequence seq's rows [r0, r0 + count) over its keys [key0, stop) as
  // `tiles` 64-key tiles of kv head kvh.
  struct Task {
    int64_t seq, kvh, r0, count, key0, stop, held, tiles;
  };
  std::vector<Task> all(tasks);
  for (int64_t task = 0; task < tasks; ++task) {
    Task& k = all[task];
    k = Task{seqs[task / kv_heads], task % kv_heads, 0, 0, 0, 0, 0, 0};
    k.r0 = starts[k.seq];
    k.count = starts[k.seq + 1] - k.r0;
    int64_t lo = where[k.r0], hi = where[k.r0];
    for (int64_t r = 1; r < k.count; ++r) {
      lo = std::min(lo, where[k.r0 + r]);
      hi = std::max(hi, where[k.r0 + r]);
    }
    k.stop = std::min<int64_t>({lens[k.seq], hi + 1, max_blocks * page_tokens});  // keys j < stop are visible
    k.key0 = window > 0 ? std::max<int64_t>(0, lo - window + 1) / kTile * kTile : 0;
    k.held = std::max<int64_t>(0, k.stop - k.key0);
    k.tiles = (k.held + kTile - 1) / kTile;
  }
  std::stable_sort(all.begin(), all.end(),
                   [](const Task& a, const Task& b) { return a.tiles * a.count > b.tiles * b.count; });
  // Key and value row pointers of the 16 keys from j (nullptr from `stop` on), walking the pages.
  const auto point = [&](const Task& k, int64_t j, const uint16_t** keys, const uint16_t** values) {
    const int32_t* table = tables + k.seq * table_stride;
    int64_t page = j / page_tokens, within = j % page_tokens;
    for (int64_t c = 0; c < kBlock; ++c, ++j) {
      const bool seen = j < k.stop;
      const int64_t slot = table[seen ? page : 0] * page_tokens + within;
      keys[c] = seen ? kc + slot * token_stride + k.kvh * dim : nullptr;
      values[c] = seen ? vc + slot * token_stride + k.kvh * dim : nullptr;
      if (++within == page_tokens) {
        within = 0;
        ++page;
      }
    }
  };
  // The packed copy of block j / 16 of a task's head, if its page is full and kept (else null):
  // packed now, by whichever task claims the page first, unless another is packing it.
  const auto from_copy = [&](const Task& k, int64_t j, const uint16_t** keys, const uint16_t** values,
                             const uint16_t** kb, const uint16_t** vb) {
    const int64_t page = j / page_tokens;
    if (kept == nullptr || (page + 1) * page_tokens > k.stop) return false;
    const int64_t phys = tables[k.seq * table_stride + page];
    if (phys < 0 || phys >= kept->pages) return false;
    std::atomic<uint8_t>& state = kept->state[phys * kv_heads + k.kvh];
    uint8_t now = state.load(std::memory_order_acquire);
    if (now == PackedPages::kStale && state.compare_exchange_strong(now, PackedPages::kPacking)) {
      for (int64_t b = 0; b < page_tokens / kBlock; ++b) {
        point(k, page * page_tokens + b * kBlock, keys, values);
        pack_block(keys, values, dim, kept->at(false, phys, k.kvh, b), kept->at(true, phys, k.kvh, b));
      }
      state.store(PackedPages::kPacked, std::memory_order_release);
      now = PackedPages::kPacked;
    }
    if (now != PackedPages::kPacked) return false;
    *kb = kept->at(false, phys, k.kvh, j % page_tokens / kBlock);
    *vb = kept->at(true, phys, k.kvh, j % page_tokens / kBlock);
    return true;
  };
  parallel_runs(tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> kpack, vpack;
    std::vector<const uint16_t*> kb, vb;
    std::vector<float> acc(6 * dim);
    const uint16_t* kr[kBlock];
    const uint16_t* vr[kBlock];
    int64_t at_pos[6];
    for (int64_t task = begin; task < end; ++task) {
      const Task& k = all[task];
      const int64_t kvh = k.kvh, r0 = k.r0, count = k.count, key0 = k.key0, held = k.held, tiles = k.tiles;
      const int64_t nblocks = tiles * kBlocksPerTile;
      kb.resize(nblocks);
      vb.resize(nblocks);
      if (static_cast<int64_t>(kpack.size()) < nblocks * block_elems) {
        kpack.resize(nblocks * block_elems);
        vpack.resize(nblocks * block_elems);
      }
      for (int64_t i = 0, packed = 0; i < nblocks; ++i) {
        const int64_t j = key0 + i * kBlock;
        if (j >= k.stop) {
          kb[i] = vb[i] = zeros;
        } else if (from_copy(k, j, kr, vr, &kb[i], &vb[i])) {  // (kept caches have whole blocks per page)
          // A kept copy is read from memory: ask for all of it into level 2 now, so that every block
          // of the task is on its way at once (30 layers of 16 rows over 400 keys: 13.0 -> 9.9 ms).
          to_level2(kb[i], block_elems);
          to_level2(vb[i], block_elems);
        } else {
          point(k, j, kr, vr);
          kb[i] = kpack.data() + packed * block_elems;
          vb[i] = vpack.data() + packed * block_elems;
          pack_block(kr, vr, dim, kpack.data() + packed * block_elems, vpack.data() + packed * block_elems);
          ++packed;
        }
      }
      if (count == 1) {  // one token: the heads sharing this kv head are the rows
        std::fill(at_pos, at_pos + 6, where[r0]);
        for (int64_t g0 = 0; g0 < group; g0 += 6) {
          const int64_t n = std::min<int64_t>(6, group - g0), first = r0 * ld + (kvh * group + g0) * dim;
          rows_through_tiles(n, qp + first, dim, at_pos, kb.data(), vb.data(), tiles, dim, key0, held, fscale, window,
                             acc.data(), op + first, dim);
        }
      } else {
        for (int64_t g = 0; g < group; ++g) {  // a chunk: each head's tokens are the rows
          for (int64_t b = 0; b < count; b += 6) {
            const int64_t n = std::min<int64_t>(6, count - b), first = (r0 + b) * ld + (kvh * group + g) * dim;
            rows_through_tiles(n, qp + first, ld, where + r0 + b, kb.data(), vb.data(), tiles, dim, key0, held,
                               fscale, window, acc.data(), op + first, ld);
          }
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "tiles_in_place: this build has no AVX512-BF16 kernel");
#endif
}

}  // namespace flare_native
