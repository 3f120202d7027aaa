// The int8-activation quantized linear kernels (linear_qa.h describes the blob and the arithmetic),
// written once over an instruction-set traits type T and instantiated by linear_qa.cpp
// (AVX512-VNNI) and linear_qa_avx2.cpp (AVX2). T::F holds 16 fp32 outputs, T::I their 16 int32
// block sums, T::W one 64-byte weight step (16 outputs x 4 bytes), T::X one row's 4 activation
// bytes broadcast as its dot products need them. T gives:
//   quantize(x, q) -> (d, S)   one 32-feature block of a row to int8 (Q8_0's rule, exactly);
//   w8 / w4, x8 / x4, dp8 / dp4 the integer steps; fix8 removes int8 weights' +128 offset where
//                              dp8 leaves it in (VNNI), else nothing; int4 steps add into a T::A
//                              (AVX2: int16 lanes, which a block's 8 products of at most
//                              2 * 15 * 127 each never overflow) that done4 widens to T::I;
//   kRows                      rows of a register block; nb(rows) blocks of 16 outputs it takes.
// Included inside each file's anonymous namespace, after T is defined. A file may define
// QA_UNROLL_INT8 / QA_UNROLL_INT4 (how far the compiler unrolls a 32-feature block's weight steps)
// first: AVX2's 16 registers spill when every step of two or more blocks is in flight at once.
#ifndef QA_UNROLL_INT8
#define QA_UNROLL_INT8 8
#endif
#ifndef QA_UNROLL_INT4
#define QA_UNROLL_INT4 4
#endif
#define QA_PRAGMA(text) _Pragma(#text)
#define QA_UNROLL(n) QA_PRAGMA(GCC unroll n)

struct QAData {  // one call's quantized activations
  const int8_t* xq;    // [rows, in]
  const float* xd;     // [rows, in / 32] scales
  const int32_t* xs;   // [rows, in / 32] sums of the block's x_q
  const float* xc;     // [rows, in / 32] d * float(S) (int4's minimum term)
};

inline void store_a8(const QCall& c, const float* sums, int64_t row, int64_t first) {
  const int64_t n = c.head->out, count = std::min<int64_t>(kBlock, n - first);
  if (count <= 0) return;
  if (c.bf16_out) {
    at::BFloat16* y = static_cast<at::BFloat16*>(c.y) + row * n + first;
    for (int64_t o = 0; o < count; ++o) y[o] = static_cast<at::BFloat16>(c.bias ? sums[o] + c.bias[first + o] : sums[o]);
  } else {
    float* y = static_cast<float*>(c.y) + row * n + first;
    for (int64_t o = 0; o < count; ++o) y[o] = c.bias ? sums[o] + c.bias[first + o] : sums[o];
  }
}

template <class T>
struct QAKernel {
  using F = typename T::F;
  using I = typename T::I;
  using W = typename T::W;
  using X = typename T::X;
  using A = typename T::A;

  // Rows [r0, r0 + MR) through blocks [b, b + NB), over every input feature. Register blocks of
  // several rows keep one or two weight streams in flight and spend longer on each line, so they ask
  // for each stream's line 1 KB ahead themselves (SmolLM2's linears from memory, 2 threads: 4-row
  // blocks on AVX512-VNNI 5-12 % sooner, 16 rows 3-5 %; on AVX2, whose blocks of 2 rows take one
  // stream, 2 rows 22-31 %, 4 rows 16-25 %, 16 rows 9-11 %). Four streams keep the memory busy
  // unasked (asking there cost 4-10 % at one row).
  static constexpr int64_t kAheadBytes = 1024;
  QK_TARGET static void prefetch_ahead(const uint8_t* at) {
    _mm_prefetch(reinterpret_cast<const char*>(at + kAheadBytes), _MM_HINT_T0);
  }

  template <int MR, int NB, bool INT4, int ST>
  QK_TARGET static void micro(const QCall& c, const QAData& a, int64_t r0, int64_t b) {
    constexpr bool kAhead = NB <= 2;
    const QHeader& h = *c.head;
    const int64_t nkb = h.in / kActBlock, per_group = h.group / kActBlock, groups = h.in / h.group;
    const int64_t sb = h.scale_bytes;
    const A8Geom geo(h);
    constexpr int64_t step_bytes = 64;
    const uint8_t* blk[NB];
    _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) blk[j] = c.blocks + (b + j) * h.block_bytes;
    const int8_t* xr[MR];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) xr[r] = a.xq + (r0 + r) * h.in;
    F acc[MR][NB];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
      _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) acc[r][j] = T::fzero();
    A8Walk walk{geo};
    for (int64_t g = 0; g < groups; ++g, walk.next()) {
      F s[NB], m[NB];
      _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) {
        const uint8_t* at = blk[j] + walk.scales(sb);
        s[j] = T::scales(at, ST);
        if constexpr (INT4) m[j] = T::scales(at + geo.mins, ST);
      }
      for (int64_t kb = g * per_group; kb < (g + 1) * per_group; ++kb) {
        I ia[MR][NB];
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
          _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) ia[r][j] = T::izero();
        const int64_t xo = kb * kActBlock, wo = walk.weights(kb - g * per_group, per_group);
        if constexpr (!INT4) {
          QA_UNROLL(QA_UNROLL_INT8) for (int st = 0; st < 8; ++st) {
            W w[NB];
            _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) {
              const uint8_t* at = blk[j] + wo + st * step_bytes;
              w[j] = T::w8(at);
              if constexpr (kAhead) prefetch_ahead(at);
            }
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
              const X xv = T::x8(xr[r] + xo + 4 * st);
              _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) ia[r][j] = T::dp8(ia[r][j], w[j], xv);
            }
          }
        } else {
          A a4[MR][NB];
          _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
            _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) a4[r][j] = T::azero();
          QA_UNROLL(QA_UNROLL_INT4) for (int st = 0; st < 4; ++st) {
            W lo[NB], hi[NB];
            _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) {
              const uint8_t* at = blk[j] + wo + st * step_bytes;
              T::w4(at, lo[j], hi[j]);
              if constexpr (kAhead) prefetch_ahead(at);
            }
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
              const X xl = T::x4(xr[r] + xo + 4 * st), xh = T::x4(xr[r] + xo + 16 + 4 * st);
              _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) a4[r][j] = T::dp4(T::dp4(a4[r][j], lo[j], xl), hi[j], xh);
            }
          }
          _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
            _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) ia[r][j] = T::done4(a4[r][j]);
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
          const int64_t i = (r0 + r) * nkb + kb;
          const F d = T::bcast(a.xd[i]);
          _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) {
            const I v = INT4 ? ia[r][j] : T::fix8(ia[r][j], a.xs[i]);
            acc[r][j] = T::fma(T::cvt(v), T::mul(s[j], d), acc[r][j]);
            if constexpr (INT4) acc[r][j] = T::fma(m[j], T::bcast(a.xc[i]), acc[r][j]);
          }
        }
      }
    }
    alignas(64) float sums[kBlock];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
      _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) {
        T::store(sums, acc[r][j]);
        store_a8(c, sums, r0 + r, (b + j) * kBlock);
      }
  }

  template <int MR, bool INT4, int ST>
  QK_TARGET static void blocks_of(const QCall& c, const QAData& a, int64_t r0, int64_t b0, int64_t b1) {
    constexpr int NB = T::nb(MR);
    int64_t b = b0;
    for (; b + NB <= b1; b += NB) micro<MR, NB, INT4, ST>(c, a, r0, b);
    if constexpr (NB >= 4) {
      if (b + 2 <= b1) {
        micro<MR, 2, INT4, ST>(c, a, r0, b);
        b += 2;
      }
    }
    if constexpr (NB >= 2) {
      for (; b < b1; ++b) micro<MR, 1, INT4, ST>(c, a, r0, b);
    }
  }

  template <bool INT4, int ST>
  QK_TARGET static void rows_of(const QCall& c, const QAData& a, int64_t r0, int64_t rows, int64_t b0, int64_t b1) {
    static_assert(T::kRows <= 4, "register blocks of up to 4 rows");
    switch (std::min<int64_t>(rows, T::kRows)) {
      case 1: return blocks_of<1, INT4, ST>(c, a, r0, b0, b1);
      case 2: return blocks_of<std::min(2, T::kRows), INT4, ST>(c, a, r0, b0, b1);
      case 3: return blocks_of<std::min(3, T::kRows), INT4, ST>(c, a, r0, b0, b1);
      default: return blocks_of<std::min(4, T::kRows), INT4, ST>(c, a, r0, b0, b1);
    }
  }

  // Blocks [b0, b1) for every row: a tile of blocks at a time (its weights stay in cache while
  // every register block of rows passes), rows split as evenly as they go (5 rows as 3 + 2).
  // Three or four rows (a decode row and its drafts) are still bound by the weight stream: they go
  // as register blocks of two rows, which keep four streams in flight, over tiles of twice the
  // blocks (the second block of rows finds them in level 2), not as one block of four rows with
  // two streams (SmolLM2's linears, 2 threads: int8 9-11 % and int4 2-4 % sooner at 3-4 rows).
  template <bool INT4, int ST>
  QK_TARGET static void span(const QCall& c, const QAData& a, int64_t b0, int64_t b1) {
    const int64_t unit = c.rows <= 4 ? std::min(2, T::kRows) : T::kRows;
    const int64_t groups = (c.rows + unit - 1) / unit;
    const int64_t tile = c.rows <= unit ? b1 - b0 : (unit < T::kRows ? 2 : 1) * T::kTile;
    for (int64_t b = b0; b < b1; b += tile) {
      const int64_t e = std::min(b1, b + tile);
      for (int64_t g = 0, r = 0; g < groups; ++g) {
        const int64_t n = c.rows / groups + (g < c.rows % groups ? 1 : 0);
        rows_of<INT4, ST>(c, a, r, n, b, e);
        r += n;
      }
    }
  }

  static void run(const QCall& c) {
    const QHeader& h = *c.head;
    const int64_t nkb = h.in / kActBlock, rows = c.rows;
    // The calling thread's scratch, kept between calls (no allocation, no zeroing per call). The
    // parallel loops below see it through these pointers: a thread_local named in a lambda run
    // on a worker thread would be that worker's own.
    static thread_local std::vector<int8_t> xq_buffer;
    static thread_local std::vector<float> xd_buffer, xc_buffer;
    static thread_local std::vector<int32_t> xs_buffer;
    if (static_cast<int64_t>(xq_buffer.size()) < rows * h.in) xq_buffer.resize(rows * h.in);
    if (static_cast<int64_t>(xd_buffer.size()) < rows * nkb) {
      xd_buffer.resize(rows * nkb);
      xc_buffer.resize(rows * nkb);
      xs_buffer.resize(rows * nkb);
    }
    int8_t* const xq = xq_buffer.data();
    float* const xd = xd_buffer.data();
    float* const xc = xc_buffer.data();
    int32_t* const xs = xs_buffer.data();
    // Rows are quantized independently (Q8_0's rule per 32-feature block): any split gives the same.
    at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / h.in), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t kb = 0; kb < nkb; ++kb) {
          const int64_t i = r * nkb + kb, at = r * c.ldx + kb * kActBlock;
          int8_t* q = xq + r * h.in + kb * kActBlock;
          c.xb != nullptr ? T::quantize(c.xb + at, q, xd[i], xs[i]) : T::quantize(c.x + at, q, xd[i], xs[i]);
          xc[i] = xd[i] * static_cast<float>(xs[i]);
        }
    });
    const QAData a{xq, xd, xs, xc};
    parallel_runs(h.blocks, run_length(h.blocks, rows <= T::kRows ? 8 : T::kTile), [&](int64_t b0, int64_t b1) {
      const int type = h.scale_type;
      if (h.bits == 4) {
        type == kScaleF16    ? span<true, kScaleF16>(c, a, b0, b1)
        : type == kScaleBF16 ? span<true, kScaleBF16>(c, a, b0, b1)
                             : span<true, kScaleF32>(c, a, b0, b1);
      } else {
        type == kScaleF16    ? span<false, kScaleF16>(c, a, b0, b1)
        : type == kScaleBF16 ? span<false, kScaleBF16>(c, a, b0, b1)
                             : span<false, kScaleF32>(c, a, b0, b1);
      }
    });
  }
};
