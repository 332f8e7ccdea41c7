// The K-quant decoders (layouts in kquant_blocks.h). Each has two forms:
//   at(block, j, s, c)     sub-block j alone (the dequantisation, as every other type)
//   factors / each_sub     the tile loop's form (ksuper_tile below): a super-block's 8 scales and mins
//                          unpacked once, in vector registers, and its 8 sub-blocks' weights produced
//                          from shared loads (two Q4_K sub-blocks are one 32-byte load's two nibbles).
// In the tile loop sub-block j's offset term, c_j·a_d·Σa over its activation block, becomes one 8-lane
// FMA a super-block, c·(a_d·Σa) for all 8 at once, summed across lanes at the end of the row.
// Included by quant_kernels.h after the vector operations (quant_vectors.h) and the Decode template.

template <> struct Decode<QType::q4_k> {
  static constexpr int kSub = kKSub;
  static constexpr bool kOffset = true;
  static TANDEM_ALWAYS_INLINE WVec at(const uint8_t* b, int j, float& s, float& c) {
    int sc, m;
    kscale_min(b + kQ4kScales, j, sc, m);
    s = load_half(b) * float(sc), c = -(load_half(b + 2) * float(m));
    // sub-blocks 2p and 2p+1 share 32 bytes: the low nibbles, then the high ones
    return widen_u8(field(load_bytes(b + kQ4kQs + 32 * (j >> 1)), 4 * (j & 1), 0x0f));
  }
  // s_j = d·sc_j (exact: 11 bits × 6), c_j = −dmin·m_j, as at() gives them.
  static TANDEM_ALWAYS_INLINE void factors(const uint8_t* b, F8& s, F8& c) {
    F8 sc, m;
    kscales8(b + kQ4kScales, sc, m);
    s = f8_mul(sc, f8_set1(load_half(b))), c = f8_mul(m, f8_set1(-load_half(b + 2)));
  }
  template <class F> static TANDEM_ALWAYS_INLINE void each_sub(const uint8_t* b, F&& f) {
    for (int p = 0; p < 4; ++p) {
      WVec lo, hi;
      widen_nibbles(b + kQ4kQs + 32 * p, lo, hi);
      f(2 * p, lo);
      f(2 * p + 1, hi);
    }
  }
};

template <> struct Decode<QType::q5_k> {
  static constexpr int kSub = kKSub;
  static constexpr bool kOffset = true;
  static TANDEM_ALWAYS_INLINE WVec at(const uint8_t* b, int j, float& s, float& c) {
    int sc, m;
    kscale_min(b + kQ5kScales, j, sc, m);
    s = load_half(b) * float(sc), c = -(load_half(b + 2) * float(m));
    const Bytes low = field(load_bytes(b + kQ5kQs + 32 * (j >> 1)), 4 * (j & 1), 0x0f);
    return widen_u8(or_high(low, field(load_bytes(b + kQ5kQh), j, 1)));  // bit j of qh[l]: the fifth bit
  }
  static TANDEM_ALWAYS_INLINE void factors(const uint8_t* b, F8& s, F8& c) {
    F8 sc, m;
    kscales8(b + kQ5kScales, sc, m);
    s = f8_mul(sc, f8_set1(load_half(b))), c = f8_mul(m, f8_set1(-load_half(b + 2)));
  }
  template <class F> static TANDEM_ALWAYS_INLINE void each_sub(const uint8_t* b, F&& f) {
    const WVec qh = load_u8(b + kQ5kQh);  // bit j: sub-block j's fifth bit, moved to bit 4
    for (int p = 0; p < 4; ++p) {
      WVec lo, hi;
      widen_nibbles(b + kQ5kQs + 32 * p, lo, hi);
      f(2 * p, or_masked(lo, shift16(qh, 4 - 2 * p), 0x10));
      f(2 * p + 1, or_masked(hi, shift16(qh, 3 - 2 * p), 0x10));
    }
  }
};

template <> struct Decode<QType::q6_k> {
  static constexpr int kSub = kKSub;
  static constexpr bool kOffset = false;  // (q − 32)·sc is folded into the int16 weight
  static TANDEM_ALWAYS_INLINE WVec at(const uint8_t* b, int j, float& s, float& c) {
    const int h = j >> 2, p = j & 3;  // 128-weight half, sub-block within it
    s = load_half(b + kQ6kD), c = 0.0f;
    const Bytes low = field(load_bytes(b + kQ6kQl + 64 * h + 32 * (p & 1)), p >= 2 ? 4 : 0, 0x0f);
    const Bytes top = field(load_bytes(b + kQ6kQh + 32 * h), 2 * p, 3);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + kQ6kSc + 2 * j);
    return centre_scale(widen_u8(or_high(low, top)), 32, sc[0], sc[1]);
  }
  static TANDEM_ALWAYS_INLINE void factors(const uint8_t* b, F8& s, F8& c) {
    s = f8_set1(load_half(b + kQ6kD)), c = f8_set1(0.0f);
  }
  // Per half: ql's two 32-byte rows give sub-blocks p and p+2 (low and high nibbles), qh's one row
  // the top two bits of all four (bits 2p, 2p+1, moved to bits 4, 5); three widenings for 4 sub-blocks.
  template <class F> static TANDEM_ALWAYS_INLINE void each_sub(const uint8_t* b, F&& f) {
    const Sc16 sc = load_sc16(reinterpret_cast<const int8_t*>(b + kQ6kSc));
    for (int h = 0; h < 2; ++h) {
      WVec low[2][2];  // [ql row][low, high nibbles]
      widen_nibbles(b + kQ6kQl + 64 * h, low[0][0], low[0][1]);
      widen_nibbles(b + kQ6kQl + 64 * h + 32, low[1][0], low[1][1]);
      const WVec qh = load_u8(b + kQ6kQh + 32 * h);
      for (int p = 0; p < 4; ++p) {
        const WVec q = or_masked(low[p & 1][p >> 1], shift16(qh, 4 - 2 * p), 0x30);
        f(4 * h + p, centre_scale_pair(q, 32, sc, 4 * h + p));
      }
    }
  }
};

// rows_tile (quant_kernels.h) for the K-quants: NT tokens from t0 over rows [r, r + R), a super-block
// at a time. Per (row, super-block, token): the 8 factors s_j·a_d (one 8-lane multiply, stored for
// the sub-blocks' broadcasts) and the offset's 8-lane FMA; per sub-block: the weights, one integer dot
// and one FMA.
template <QType TY, int NT, int R>
TANDEM_ALWAYS_INLINE void ksuper_tile(const QuantMatmulProblem& P, const QuantActs& A, int64_t t0, int64_t r) {
  using D = Decode<TY>;
  constexpr int64_t bytes = qblock_bytes(int(TY));
  const int64_t nb = P.k / kQBlock;
  const int16_t* a = A.q + t0 * P.k;
  const float* ad = A.d + t0 * nb;
  const float* as = A.s + t0 * nb;
  const uint8_t* row = P.w + r * P.w_row_bytes;
  FVec acc[R][NT];
  F8 offset[R][NT];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = fzero(), offset[i][t] = f8_set1(0.0f);
  for (int64_t sb = 0; sb < nb / kKSub; ++sb) {
    const int64_t b0 = sb * kKSub;  // the super-block's first activation block
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = row + i * P.w_row_bytes + sb * bytes;
#if !defined(TANDEM_QUANT_SCALAR)
      // the next tile's rows at the same place (quant_kernels.h's rows_tile says why), a line at a time
      for (int64_t at = 0; at < bytes; at += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + R * P.w_row_bytes + at), _MM_HINT_T0);
#endif
      F8 s, c;
      D::factors(blk, s, c);
      alignas(32) float f[NT][kKSub];  // s_j·a_d of each sub-block and token
      for (int t = 0; t < NT; ++t) {
        f8_store(f[t], f8_mul(s, f8_load(ad + t * nb + b0)));
        if constexpr (D::kOffset) offset[i][t] = f8_fmadd(c, f8_load(as + t * nb + b0), offset[i][t]);
      }
      factors_in_memory(&f[0][0]);
      D::each_sub(blk, [&](int j, const WVec& w) {
        for (int t = 0; t < NT; ++t)
          acc[i][t] = fmadd(block_dot(w, a + t * P.k + (b0 + j) * kQBlock), f[t][j], acc[i][t]);
      });
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) P.y[(t0 + t) * P.y_stride + r + i] = hsum(acc[i][t]) + f8_hsum(offset[i][t]);
}
