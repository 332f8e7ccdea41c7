// The K-quant decoders (layouts in kquant_blocks.h). Each has two forms:
//   at(block, j, s, c)     sub-block j alone (the dequantisation, as every other type)
//   factors / each_sub     the tile loop's form (ksuper_tile below): a super-block's 8 scales and mins
//                          unpacked once, in vector registers, and its 8 sub-blocks' weights produced
//                          from shared loads (two Q4_K sub-blocks are one 32-byte load's two nibbles).
// In the tile loop sub-block j's offset term, c_j·a_d·Σa over its activation block, becomes one 8-lane
// FMA a super-block, c·(a_d·Σa) for all 8 at once, summed across lanes at the end of the row.
// AVX2 and AVX-512 have a third form (scales8 / finish8 and, per ISA, scale8 / each_sub8 or
// scale_pair / each_pair8; ksuper_tile_i8 at the end): the weights as u8 against int8 activations,
// integer sums over the whole super-block. AVX2 takes a sub-block at a time, AVX-512 two.
// Included by quant_kernels.h after the vector operations (quant_vectors.h) and the Decode template.

#if defined(TANDEM_QUANT_INT8)
// The int8 form (ksuper_tile_i8 below) of Q4_K/Q5_K's scales: sc the 8 scales as words in both 128-bit
// lanes (pick_words broadcasts one), mn the 8 mins as words, each twice (words 2j, 2j+1 = m_j: one
// vpmaddwd against the 16 activation sums of 16 values gives m_j·Σa over sub-block j).
struct KScales8 { __m256i sc, mn; };
TANDEM_ALWAYS_INLINE KScales8 kscales_int(const uint8_t* scales) {
  const __m128i both = kscale_bytes(scales);
  return {_mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(both)), _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(both, both))};
}
// acc + d·a_d·Σ sc_j·q·a and off − dmin·a_d·Σ_j m_j·Σa_j: the super-block's two integer sums, one FMA
// each (sum: 8 lanes, or AVX-512's 16 of a pair, into an accumulator of as many).
template <class Sum, class Acc>
TANDEM_ALWAYS_INLINE void kfinish_min(float d, float dmin, const KScales8& S, Sum sum, const int16_t* bs, float ad,
                                      Acc& acc, F8& off) {
  const I32x8 mins = _mm256_madd_epi16(S.mn, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs)));
  acc = fmadd_i32(sum, d * ad, acc), off = fmadd_i32(mins, -(dmin * ad), off);
}
#endif

#if defined(TANDEM_QUANT_AVX512)
// Pair p's scale word for each of its 32 maddubs words (pick_words2): words_per_scale 16 where a
// sub-block has one scale (Q4_K, Q5_K: words 0–15 scale 2p, 16–31 scale 2p + 1), 8 where it has two
// (Q6_K: scales 4p … 4p + 3, eight words each).
struct PairIndex { alignas(64) int16_t w[4][32]; };
constexpr PairIndex pair_index(int words_per_scale) {
  PairIndex x{};
  for (int p = 0; p < 4; ++p)
    for (int i = 0; i < 32; ++i) x.w[p][i] = int16_t((32 * p + i) / words_per_scale);
  return x;
}
constexpr PairIndex kOneScalePairs = pair_index(16), kTwoScalePairs = pair_index(8);
TANDEM_ALWAYS_INLINE __m512i pair_scales(__m256i words, const PairIndex& index, int p) {
  return pick_words2(words, _mm512_load_si512(index.w[p]));
}
#endif

// What Q4_K's and Q5_K's int8 forms share: their scales and mins (both at byte kQ4kScales ==
// kQ5kScales), how a sub-block or pair picks its scale, and the finish with the mins' term.
struct KMinsInt8 {
#if defined(TANDEM_QUANT_INT8)
  static_assert(kQ4kScales == kQ5kScales);
  using Scales8 = KScales8;
  static TANDEM_ALWAYS_INLINE Scales8 scales8(const uint8_t* b) { return kscales_int(b + kQ4kScales); }
  template <class Sum, class Acc>
  static TANDEM_ALWAYS_INLINE void finish8(const uint8_t* b, const Scales8& S, Sum sum, const int16_t* bs, float ad,
                                           Acc& acc, F8& off) {
    kfinish_min(load_half(b), load_half(b + 2), S, sum, bs, ad, acc, off);
  }
#endif
#if defined(TANDEM_QUANT_AVX2)
  static TANDEM_ALWAYS_INLINE __m256i scale8(const Scales8& S, int j) { return pick_words(S.sc, j, j); }
#elif defined(TANDEM_QUANT_AVX512)
  static TANDEM_ALWAYS_INLINE __m512i scale_pair(const Scales8& S, int p) {
    return pair_scales(S.sc, kOneScalePairs, p);
  }
#endif
};

template <> struct Decode<QType::q4_k> : KMinsInt8 {
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
#if defined(TANDEM_QUANT_AVX2)
  template <class F> static TANDEM_ALWAYS_INLINE void each_sub8(const uint8_t* b, F&& f) {
    for (int p = 0; p < 4; ++p) {
      const Bytes raw = load_bytes(b + kQ4kQs + 32 * p);
      f(2 * p, field(raw, 0, 0x0f));
      f(2 * p + 1, field(raw, 4, 0x0f));
    }
  }
#elif defined(TANDEM_QUANT_AVX512)
  // Pair p (sub-blocks 2p, 2p + 1) is one 32-byte row: its low nibbles, then its high ones.
  template <class F> static TANDEM_ALWAYS_INLINE void each_pair8(const uint8_t* b, F&& f) {
    for (int p = 0; p < 4; ++p) f(p, halves(both_halves(b + kQ4kQs + 32 * p), 0, 4, 0x0f));
  }
#endif
};

template <> struct Decode<QType::q5_k> : KMinsInt8 {
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
#if defined(TANDEM_QUANT_AVX2)
  template <class F> static TANDEM_ALWAYS_INLINE void each_sub8(const uint8_t* b, F&& f) {
    const Bytes qh = load_bytes(b + kQ5kQh);  // bit j: sub-block j's fifth bit, moved to bit 4
    for (int p = 0; p < 4; ++p) {
      const Bytes raw = load_bytes(b + kQ5kQs + 32 * p);
      f(2 * p, or_shifted(field(raw, 0, 0x0f), qh, 4 - 2 * p, 0x10));
      f(2 * p + 1, or_shifted(field(raw, 4, 0x0f), qh, 3 - 2 * p, 0x10));
    }
  }
#elif defined(TANDEM_QUANT_AVX512)
  // As Q4_K's pairs, with bit 2p (low half) or 2p + 1 (high half) of qh as the fifth bit.
  template <class F> static TANDEM_ALWAYS_INLINE void each_pair8(const uint8_t* b, F&& f) {
    const __m512i qh = both_halves(b + kQ5kQh);
    for (int p = 0; p < 4; ++p)
      f(p, or_high2(halves(both_halves(b + kQ5kQs + 32 * p), 0, 4, 0x0f), halves(qh, 2 * p, 2 * p + 1, 1)));
  }
#endif
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
#if defined(TANDEM_QUANT_INT8)
  // The 16 int8 scales as words: all (for the centring term and AVX-512's pairs) and, for AVX2, each
  // 128-bit half in both lanes (sub-block j's pair, words 2j and 2j+1, picked from one of them).
  struct Scales8 { __m256i all, low, high; };
  static TANDEM_ALWAYS_INLINE Scales8 scales8(const uint8_t* b) {
    const __m256i all = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kQ6kSc)));
    return {all, _mm256_permute2x128_si256(all, all, 0x00), _mm256_permute2x128_si256(all, all, 0x11)};
  }
  // Σ sc·(q − 32)·a = Σ sc·q·a − 32·Σ_i sc_i·bsum_i (i over the 16 scales, bsum over their 16 values):
  // both sums exact in int32 (|Σ sc·q·a| ≤ 256·128·63·127 < 2^29) and in their float conversions
  // (|Σ sc_i·bsum_i| ≤ 16·128·16·127 < 2^24), then one FMA each by d·a_d.
  template <class Sum, class Acc>
  static TANDEM_ALWAYS_INLINE void finish8(const uint8_t* b, const Scales8& S, Sum sum, const int16_t* bs, float ad,
                                           Acc& acc, F8& off) {
    const __m256i centre = _mm256_madd_epi16(S.all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs)));
    const float f = load_half(b + kQ6kD) * ad;
    acc = fmadd_i32(sum, f, acc), off = fmadd_i32(centre, -32.0f * f, off);
  }
#endif
#if defined(TANDEM_QUANT_AVX2)
  static TANDEM_ALWAYS_INLINE __m256i scale8(const Scales8& S, int j) {
    return j < 4 ? pick_words(S.low, 2 * j, 2 * j + 1) : pick_words(S.high, 2 * j - 8, 2 * j - 7);
  }
  // q (0…63) as u8; the −32 comes back in finish8.
  template <class F> static TANDEM_ALWAYS_INLINE void each_sub8(const uint8_t* b, F&& f) {
    for (int h = 0; h < 2; ++h) {
      const Bytes ql[2] = {load_bytes(b + kQ6kQl + 64 * h), load_bytes(b + kQ6kQl + 64 * h + 32)};
      const Bytes qh = load_bytes(b + kQ6kQh + 32 * h);
      for (int p = 0; p < 4; ++p) f(4 * h + p, or_shifted(field(ql[p & 1], p >= 2 ? 4 : 0, 0x0f), qh, 4 - 2 * p, 0x30));
    }
  }
#elif defined(TANDEM_QUANT_AVX512)
  static TANDEM_ALWAYS_INLINE __m512i scale_pair(const Scales8& S, int p) {
    return pair_scales(S.all, kTwoScalePairs, p);
  }
  // Per half h, ql's two 32-byte rows are one 64-byte load: its low nibbles are the pair (4h, 4h + 1),
  // its high ones (4h + 2, 4h + 3); qh's row gives their top bits (bits 2p, 2p + 1 of sub-block 4h + p).
  // q (0…63) as u8; the −32 comes back in finish8.
  template <class F> static TANDEM_ALWAYS_INLINE void each_pair8(const uint8_t* b, F&& f) {
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(b + kQ6kQl + 64 * h);
      const __m512i qh = both_halves(b + kQ6kQh + 32 * h);
      for (int n = 0; n < 2; ++n)
        f(2 * h + n, or_high2(halves(ql, 4 * n, 4 * n, 0x0f), halves(qh, 4 * n, 4 * n + 2, 3)));
    }
  }
#endif
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

#if defined(TANDEM_QUANT_INT8)
// ksuper_tile over the int8 form (AVX2, AVX-512): a super-block's weights stay u8 and meet the int8
// activations in vpmaddubsw, each sub-block's integer scale is applied by vpmaddwd, and the 8
// sub-blocks add up in int32; per (row, super-block, token) the weight-independent terms (mins, Q6_K's
// centring) come from the activations' 16-value sums, and one or two conversions and FMAs turn the lot
// into floats. Per sub-block and token that is a load, vpmaddubsw, vpmaddwd and an add (AVX-512: the
// same for two sub-blocks at once), where the int16 form takes a vpmaddwd, a conversion and an FMA
// per sub-block after widening the weights to words. These products are bound by instructions, not
// by memory: on one AVX-512 core a 768×2048 Q4_K expert matrix at 32 tokens took 954 µs in this form
// (841 with VNNI's vpdpwssd) where the int16 form had taken 1438. The price is the activations' int8
// rounding, max|x|/254 over each 256 values at most.
template <QType TY, int NT, int R>
TANDEM_ALWAYS_INLINE void ksuper_tile_i8(const QuantMatmulProblem& P, const QuantActs& A, int64_t t0, int64_t r) {
  using D = Decode<TY>;
  constexpr int64_t bytes = qblock_bytes(int(TY));
  constexpr int64_t kSums = kQKBlock / 16;  // activation sums a super-block
  const int64_t ns = P.k / kQKBlock;
  const int8_t* a = A.q8 + t0 * P.k;
  const float* ad = A.d8 + t0 * ns;
  const int16_t* bs = A.b8 + t0 * ns * kSums;
  const uint8_t* row = P.w + r * P.w_row_bytes;
  FVec acc[R][NT];  // the weights' term (AVX-512: 16 lanes, a pair's sums unfolded)
  F8 off[R][NT];    // the mins' or the centring's term
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = fzero(), off[i][t] = f8_set1(0.0f);
  for (int64_t sb = 0; sb < ns; ++sb) {
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = row + i * P.w_row_bytes + sb * bytes;
      for (int64_t at = 0; at < bytes; at += 64)  // the next tile's rows, as ksuper_tile
        _mm_prefetch(reinterpret_cast<const char*>(blk + R * P.w_row_bytes + at), _MM_HINT_T0);
      const typename D::Scales8 S = D::scales8(blk);
#if defined(TANDEM_QUANT_AVX512)
      __m512i sum[NT];  // two sub-blocks' lanes at a time
      for (int t = 0; t < NT; ++t) sum[t] = _mm512_setzero_si512();
      D::each_pair8(blk, [&](int p, Pair q) {
        const __m512i sc = D::scale_pair(S, p);
        for (int t = 0; t < NT; ++t)
          sum[t] = dot2_u8s8_add(sum[t], q, a + t * P.k + sb * kQKBlock + 64 * p, sc);
      });
#else
      I32x8 sum[NT];
      for (int t = 0; t < NT; ++t) sum[t] = i32_zero();
      D::each_sub8(blk, [&](int j, Bytes q) {
        const __m256i sc = D::scale8(S, j);
        for (int t = 0; t < NT; ++t) sum[t] = i32_add(sum[t], dot_u8s8(q, a + t * P.k + sb * kQKBlock + 32 * j, sc));
      });
#endif
      for (int t = 0; t < NT; ++t)
        D::finish8(blk, S, sum[t], bs + (t * ns + sb) * kSums, ad[t * ns + sb], acc[i][t], off[i][t]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) P.y[(t0 + t) * P.y_stride + r + i] = hsum(acc[i][t]) + f8_hsum(off[i][t]);
}
#endif
