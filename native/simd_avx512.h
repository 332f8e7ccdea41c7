// AVX-512 (F, BW, VL, DQ) vectors of 16 fp32 lanes; VDPBF16PS when TANDEM_DPBF16 is defined.
// Included inside an anonymous namespace of an ISA translation unit, after its target pragma.

struct Simd {
  static constexpr int W = 16;        // fp32 lanes
  static constexpr int kMaxGroup = 16;  // query rows whose accumulators stay in registers at once
#ifdef TANDEM_DPBF16
  static constexpr bool kDpbf16 = true;
#else
  static constexpr bool kDpbf16 = false;
#endif
  using V = __m512;
  using VI = __m512i;  // 2·W raw bf16 elements

  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float lane0(V v) { return _mm512_cvtss_f32(v); }
  // One cache line into L2 (prefetcht0, into L1, measured slower: it competes with the compute's
  // loads). An asm statement because GCC 12 drops some __builtin_prefetch as dead code; the address
  // goes in a register (an "m" operand would make GCC flush register-held arrays to memory first).
  static void prefetch(const void* p) { __asm__ volatile("prefetcht1 (%0)" : : "r"(p)); }
  // Some lane > x (NaN lanes are not).
  static bool any_greater(V a, float x) { return _mm512_cmp_ps_mask(a, _mm512_set1_ps(x), _CMP_GT_OQ) != 0; }
  static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }

  // W elements of dtype D as fp32.
  template <DType D> static V load_f32(const typename Elem<D>::type* p) {
    if constexpr (D == DType::f32) {
      return _mm512_loadu_ps(p);
    } else if constexpr (D == DType::bf16) {  // bf16 is the top half of an fp32
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    } else {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
  }

  // Lanes i ≥ n replaced by `fill`.
  static V first_n(V v, int n, float fill) {
    return _mm512_mask_blend_ps(__mmask16((1u << n) - 1u), _mm512_set1_ps(fill), v);
  }

  // 2^x for x ≤ 0 (clamped at −126, where the result is negligible): x = k + f, f ∈ [−½, ½],
  // 2^f by its degree-7 Taylor polynomial (error < 1e-8 relative), scaled by 2^k.
  static V exp2(V x) {
    x = _mm512_max_ps(_mm512_set1_ps(-126.0f), x);  // this operand order lets a NaN through
    const V k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V f = _mm512_sub_ps(x, k);
    V p = _mm512_set1_ps(1.525273380405984e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284770e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
  }

  // Lane i of the result = sum of the lanes of a[i], for 16 vectors: a transpose folded into adds.
  TANDEM_ALWAYS_INLINE static V transpose_reduce(const V* a) {
    V b[8], c[4];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, a'0+a'2, a1+a3, a'1+a'3] of the pair
      b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: the 4 vectors' partial sums, in order
      c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const V d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
    const V d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xdd));
  }

  // W fp32 → bf16 (round to nearest even; NaN stays NaN).
  static void store_bf16(uint16_t* dst, V v) {
#ifdef TANDEM_DPBF16
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
#else
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
#endif
  }

  // Pairwise bf16 dot: lane i += a[2i]·b[2i] + a[2i+1]·b[2i+1] (products exact, fp32 sums).
  // 2·W raw bf16 → their even elements and their odd elements as fp32 (exact: bf16 is the top
  // half of an fp32), without the shuffles of a widening conversion.
  static V bf16_even(VI x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
  static V bf16_odd(VI x) { return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(int(0xffff0000u)))); }
  static VI load_raw(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static V dp(V acc, VI a, VI b) {
#ifdef TANDEM_DPBF16
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else  // even elements are the low halves of 32-bit lanes, odd ones the high halves
    const __m512i hi_mask = _mm512_set1_epi32(int(0xffff0000u));
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                          _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi_mask)),
                           _mm512_castsi512_ps(_mm512_and_si512(b, hi_mask)), acc);
#endif
  }
};
