// AVX2 + FMA + F16C vectors of 8 fp32 lanes.
// Included inside an anonymous namespace of an ISA translation unit, after its target pragma.

struct Simd {
  static constexpr int W = 8;
  static constexpr int kMaxGroup = 8;  // 16 ymm registers: 8 accumulators + operands
  static constexpr bool kDpbf16 = false;
  using V = __m256;
  using VI = __m256i;

  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float lane0(V v) { return _mm256_cvtss_f32(v); }
  // One cache line into L2 (prefetcht0, into L1, measured slower: it competes with the compute's
  // loads). An asm statement because GCC 12 drops some __builtin_prefetch as dead code; the address
  // goes in a register (an "m" operand would make GCC flush register-held arrays to memory first).
  static void prefetch(const void* p) { __asm__ volatile("prefetcht1 (%0)" : : "r"(p)); }
  // Some lane > x (NaN lanes are not).
  static bool any_greater(V a, float x) { return _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(x), _CMP_GT_OQ)) != 0; }
  static float reduce_add(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float reduce_max(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }

  template <DType D> static V load_f32(const typename Elem<D>::type* p) {
    if constexpr (D == DType::f32) {
      return _mm256_loadu_ps(p);
    } else if constexpr (D == DType::bf16) {
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    } else {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
  }

  static V first_n(V v, int n, float fill) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), v, keep);
  }

  // 2^x for x ≤ 0 (see the AVX-512 version); 2^k built in the exponent bits.
  static V exp2(V x) {
    x = _mm256_max_ps(_mm256_set1_ps(-126.0f), x);
    const V k = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V f = _mm256_sub_ps(x, k);
    V p = _mm256_set1_ps(1.525273380405984e-05f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284770e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-02f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const V k_clamped = _mm256_min_ps(k, _mm256_set1_ps(127.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k_clamped), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }

  // Lane i = sum of a[i], for 8 vectors.
  TANDEM_ALWAYS_INLINE static V transpose_reduce(const V* a) {
    V b[4];
    for (int i = 0; i < 4; ++i)
      b[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    const V c0 = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const V c1 = _mm256_add_ps(_mm256_shuffle_ps(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm256_shuffle_ps(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
  }

  static void store_bf16(uint16_t* dst, V v) {  // W fp32 → bf16 (off the hot paths here)
    alignas(32) float f[W];
    store(f, v);
    for (int i = 0; i < W; ++i) dst[i] = f32_to_bf16(f[i]);
  }
  // 2·W raw bf16 → their even elements and their odd elements as fp32 (exact: bf16 is the top
  // half of an fp32), without the shuffles of a widening conversion.
  static V bf16_even(VI x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
  static V bf16_odd(VI x) { return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int(0xffff0000u)))); }
  static VI load_raw(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static V dp(V acc, VI a, VI b) {  // pairwise bf16 dot through fp32 (see simd_avx512.h)
    const __m256i hi_mask = _mm256_set1_epi32(int(0xffff0000u));
    acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                          _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), acc);
    return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, hi_mask)),
                           _mm256_castsi256_ps(_mm256_and_si256(b, hi_mask)), acc);
  }
};
