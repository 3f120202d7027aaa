// The quantized linear kernels (linear_q.h describes the blob and the reduction order), written
// once over an instruction-set traits type T and instantiated by linear_q.cpp (AVX-512) and
// linear_q_avx2.cpp (AVX2+FMA). T::F holds one block's 16 fp32 outputs (one zmm, or two ymm); T
// gives the few operations the kernels need (load, broadcast, fma, mul, add, widening of scales
// and of int8 / int4 weights) and its register blocking:
//   kFewRows   rows up to which weights are dequantized in registers as they stream (decode);
//   kFewBlocks blocks those rows take at once (weight streams in flight);
//   kTile      blocks per many-row task: each 64-feature slice of the tile's weights is
//              dequantized once into an L1 buffer and every row of a panel reads it from there;
//   kRows, kMicroBlocks  the register block of rows x blocks of that many-row micro-kernel.
// Included inside each file's anonymous namespace, after T is defined.

constexpr int64_t kChunk = 32;   // features dequantized at a time into the many-row buffer
constexpr int64_t kPanel = 48;   // rows whose inputs and partial sums stay in L2 while a tile's chunks pass

inline int64_t group_bytes(const QHeader& h) {
  const int64_t weights = h.bits == 8 ? h.group * kBlock : h.group / 2 * kBlock;
  return h.scale_bytes * kBlock * (h.bits == 4 ? 2 : 1) + weights;
}

// One row's 16 sums of the block starting at output `first` (+ bias) into y (rounded to bfloat16
// nearest-even as torch casts, or kept), outputs past `out` dropped.
inline void store_sums(const QCall& c, const float* sums, int64_t row, int64_t first) {
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
struct QKernel {
  using F = typename T::F;

  // An int4 weight's value q * scale + min. With bfloat16 or float16 scales q * scale (4 x 8 or
  // 4 x 11 significant bits) is exact, so one fused multiply-add rounds it as dequantize's product
  // then sum does; with float32 scales the product rounds first.
  template <int ST>
  QK_TARGET static F value4(F q, F s, F m) {
    if constexpr (ST != kScaleF32) {
      return T::fma(q, s, m);
    } else {
      return T::add(T::mul(q, s), m);
    }
  }

  // Rows [r0, r0 + MR) through blocks [b, b + NB): weights dequantized in registers as they
  // stream; sums stored per row.
  template <int MR, int NB, int ST>
  QK_TARGET static void few(const QCall& c, int64_t r0, int64_t b) {
    const QHeader& h = *c.head;
    const int64_t gb = group_bytes(h), groups = h.in / h.group, sb = h.scale_bytes, ldx = c.ldx;
    F acc[MR][NB];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
      _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) acc[r][j] = T::zero();
    const uint8_t* base = c.blocks + b * h.block_bytes;
    const float* x = c.x + r0 * ldx;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* gp[NB];
      F s[NB];
      _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) {
        gp[j] = base + j * h.block_bytes + g * gb;
        s[j] = T::scales(gp[j], ST);
      }
      const float* xg = x + g * h.group;
      if (h.bits == 8) {
        for (int64_t k = 0; k < h.group; ++k) {
          _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) {
            const F w = T::mul(T::i8(gp[j] + kBlock * sb + k * kBlock), s[j]);
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) acc[r][j] = T::fma(T::bcast(xg + r * ldx + k), w, acc[r][j]);
          }
        }
      } else {
        F m[NB];
        _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) m[j] = T::scales(gp[j] + kBlock * sb, ST);
        for (int64_t p = 0; p < h.group / 2; ++p) {
          _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) {
            F lo, hi;
            T::u4(gp[j] + 2 * kBlock * sb + p * kBlock, lo, hi);
            const F w0 = value4<ST>(lo, s[j], m[j]);
            const F w1 = value4<ST>(hi, s[j], m[j]);
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) acc[r][j] = T::fma(T::bcast(xg + r * ldx + 2 * p), w0, acc[r][j]);
            _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) acc[r][j] = T::fma(T::bcast(xg + r * ldx + 2 * p + 1), w1, acc[r][j]);
          }
        }
      }
    }
    alignas(64) float sums[kBlock];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
      _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) {
        T::store(sums, acc[r][j]);
        store_sums(c, sums, r0 + r, (b + j) * kBlock);
      }
  }

  template <int NB, int ST>
  QK_TARGET static void few_rows(const QCall& c, int64_t r0, int64_t rows, int64_t b) {
    switch (rows) {
      case 1: return few<1, NB, ST>(c, r0, b);
      case 2: return few<std::min(2, T::kFewRows), NB, ST>(c, r0, b);
      case 3: return few<std::min(3, T::kFewRows), NB, ST>(c, r0, b);
      default: return few<std::min(4, T::kFewRows), NB, ST>(c, r0, b);
    }
  }

  // Blocks [b0, b1) for every row (rows <= kFewRows), kFewBlocks at a time.
  // Blocks [b0, b1) for every row (rows <= kFewRows): kFewBlocks at a time, the rest by halves.
  template <int ST>
  QK_TARGET static void few_blocks(const QCall& c, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1;) {
      const int64_t left = b1 - b;
      if (left >= T::kFewBlocks) {
        few_rows<T::kFewBlocks, ST>(c, 0, c.rows, b);
        b += T::kFewBlocks;
      } else if (left >= 2) {
        few_rows<2, ST>(c, 0, c.rows, b);
        b += 2;
      } else {
        few_rows<1, ST>(c, 0, c.rows, b);
        b += 1;
      }
    }
  }

  // Features [k0, k0 + kc) of blocks [b, b + nb) dequantized into buf[kc][kTile][16].
  QK_TARGET static void dequant(const QCall& c, int64_t b, int64_t nb, int64_t k0, int64_t kc, float* buf) {
    const QHeader& h = *c.head;
    const int64_t gb = group_bytes(h), sb = h.scale_bytes, ld = T::kTile * kBlock;
    const int st = h.scale_type;
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* base = c.blocks + (b + j) * h.block_bytes;
      for (int64_t k = k0; k < k0 + kc;) {
        const int64_t g = k / h.group, end = std::min(k0 + kc, (g + 1) * h.group);
        const uint8_t* gp = base + g * gb;
        const F s = T::scales(gp, st);
        if (h.bits == 8) {
          const uint8_t* q = gp + kBlock * sb - g * h.group * kBlock;
          for (; k < end; ++k) T::store(buf + (k - k0) * ld + j * kBlock, T::mul(T::i8(q + k * kBlock), s));
        } else {
          const F m = T::scales(gp + kBlock * sb, st);
          const uint8_t* q = gp + 2 * kBlock * sb - g * h.group / 2 * kBlock;
          for (; k < end; k += 2) {
            F lo, hi;
            T::u4(q + k / 2 * kBlock, lo, hi);
            T::store(buf + (k - k0) * ld + j * kBlock, st != kScaleF32 ? value4<kScaleBF16>(lo, s, m) : value4<kScaleF32>(lo, s, m));
            T::store(buf + (k + 1 - k0) * ld + j * kBlock, st != kScaleF32 ? value4<kScaleBF16>(hi, s, m) : value4<kScaleF32>(hi, s, m));
          }
        }
      }
    }
  }

  // MR rows x NB blocks over a dequantized chunk: acc (row stride ldacc) continues their chains.
  template <int MR, int NB>
  QK_TARGET static void micro(const float* x, int64_t ldx, const float* buf, int64_t kc, float* acc_io, int64_t ldacc,
                              bool first) {
    F acc[MR][NB];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
      _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) acc[r][j] = first ? T::zero() : T::load(acc_io + r * ldacc + j * kBlock);
    const int64_t ld = T::kTile * kBlock;
    for (int64_t k = 0; k < kc; ++k) {
      F w[NB];
      _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) w[j] = T::load(buf + k * ld + j * kBlock);
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        const F a = T::bcast(x + r * ldx + k);
        _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) acc[r][j] = T::fma(a, w[j], acc[r][j]);
      }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
      _Pragma("GCC unroll 8") for (int j = 0; j < NB; ++j) T::store(acc_io + r * ldacc + j * kBlock, acc[r][j]);
  }

  template <int NB>
  QK_TARGET static void micro_rows(int64_t rows, const float* x, int64_t ldx, const float* buf, int64_t kc, float* acc,
                                   int64_t ldacc, bool first) {
    switch (rows) {
      case 1: return micro<1, NB>(x, ldx, buf, kc, acc, ldacc, first);
      case 2: return micro<2, NB>(x, ldx, buf, kc, acc, ldacc, first);
      case 3: return micro<3, NB>(x, ldx, buf, kc, acc, ldacc, first);
      case 4: return micro<4, NB>(x, ldx, buf, kc, acc, ldacc, first);
      case 5: return micro<std::min(5, T::kRows), NB>(x, ldx, buf, kc, acc, ldacc, first);
      default: return micro<std::min(6, T::kRows), NB>(x, ldx, buf, kc, acc, ldacc, first);
    }
  }

  // Tile of blocks [b, b + nb) for every row, panel by panel, chunk by chunk.
  QK_TARGET static void many(const QCall& c, int64_t b, int64_t nb, float* buf, float* acc) {
    const QHeader& h = *c.head;
    const int64_t ldacc = T::kTile * kBlock;
    for (int64_t p0 = 0; p0 < c.rows; p0 += kPanel) {
      const int64_t p1 = std::min(c.rows, p0 + kPanel), n = p1 - p0;
      const int64_t groups = (n + T::kRows - 1) / T::kRows;  // as even as they go: 8 rows as 4 + 4
      for (int64_t k0 = 0; k0 < h.in; k0 += kChunk) {
        const int64_t kc = std::min(kChunk, h.in - k0);
        dequant(c, b, nb, k0, kc, buf);
        for (int64_t g = 0, m = p0; g < groups; ++g) {
          const int64_t r = n / groups + (g < n % groups ? 1 : 0);
          const float* xm = c.x + m * c.ldx + k0;
          float* am = acc + (m - p0) * ldacc;
          for (int64_t j = 0; j < nb;) {
            if (nb - j >= T::kMicroBlocks) {
              micro_rows<T::kMicroBlocks>(r, xm, c.ldx, buf + j * kBlock, kc, am + j * kBlock, ldacc, k0 == 0);
              j += T::kMicroBlocks;
            } else if (T::kMicroBlocks >= 4 && nb - j >= 2) {
              micro_rows<std::min(2, T::kMicroBlocks)>(r, xm, c.ldx, buf + j * kBlock, kc, am + j * kBlock, ldacc,
                                                       k0 == 0);
              j += 2;
            } else {
              micro_rows<1>(r, xm, c.ldx, buf + j * kBlock, kc, am + j * kBlock, ldacc, k0 == 0);
              j += 1;
            }
          }
          m += r;
        }
      }
      for (int64_t r = p0; r < p1; ++r)
        for (int64_t j = 0; j < nb; ++j) store_sums(c, acc + (r - p0) * ldacc + j * kBlock, r, (b + j) * kBlock);
    }
  }

  // Threads take runs of blocks in turn (common.h: parallel_runs), never part of a block.
  static void run(const QCall& c) {
    const int64_t blocks = c.head->blocks;
    if (c.rows <= T::kFewRows) {
      parallel_runs(blocks, run_length(blocks, T::kFewBlocks), [&](int64_t b0, int64_t b1) {
        switch (c.head->scale_type) {
          case kScaleBF16: return few_blocks<kScaleBF16>(c, b0, b1);
          case kScaleF16: return few_blocks<kScaleF16>(c, b0, b1);
          default: return few_blocks<kScaleF32>(c, b0, b1);
        }
      });
      return;
    }
    parallel_runs(blocks, run_length(blocks, T::kTile), [&](int64_t b0, int64_t b1) {
      std::vector<float> buf(kChunk * T::kTile * kBlock + 16), acc(std::min(c.rows, kPanel) * T::kTile * kBlock + 16);
      float* bufp = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
      float* accp = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(acc.data()) + 63) & ~uintptr_t(63));
      for (int64_t b = b0; b < b1; b += T::kTile) many(c, b, std::min<int64_t>(T::kTile, b1 - b), bufp, accp);
    });
  }
};
