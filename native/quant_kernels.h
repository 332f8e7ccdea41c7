// The quantised matrix-vector kernels, included by each isa_quant_*.cpp inside its target pragma and
// an anonymous namespace (as the other ISA kernels are). The including file defines one of
//   TANDEM_QUANT_AVX512  a block as one 512-bit vector of 32 int16 weights: vpmaddwd with the
//                        activation block, 16 int32 partial sums
//   TANDEM_QUANT_AVX2    the same as two 256-bit halves
//   TANDEM_QUANT_SCALAR  plain loops
// Activations are quantised per 32-block to int16 (scale a_d = max|x|/32767) and weights widened to
// int16, so a block's dot product is exact in int32 and the only rounding besides fp32's is the
// activation's, 2^-16 of the block's largest value. int8 activations (llama.cpp's vec_dot, vpmaddubsw /
// vpdpbusd) are 256 times coarser: with them the built-in model's greedy answer to the README's
// question changed ("L'Étoile, la Marseillaise …" instead of "The capital of France is Paris."),
// and vpmaddwd takes a block in one 512-bit instruction all the same. Each block's int32 sums become
// float and are scaled by d·a_d into the token's float lanes (one convert, one FMA per block and
// token). Tokens run in groups (kGroup) over a chunk of rows, so a row's blocks are unpacked once per
// group and re-read from L1 by the next group.
//
// Needs quant_blocks.h and convert.h (f16_to_f32) included before.

constexpr int kGroup = 4;  // 4 float accumulators + the weight and temporaries fit 16 vector registers

TANDEM_ALWAYS_INLINE float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(TANDEM_QUANT_SCALAR)
  return f16_to_f32(h);
#else
  return _cvtsh_ss(h);
#endif
}

// One token's activations → int16 blocks: d = max|x|/32767 per block (0 for an all-zero block),
// q = x/d rounded to nearest even, s = d·Σq.
void quantize_acts(const float* x, int64_t k, int16_t* q, float* d, float* s) {
  for (int64_t b = 0; b < k / kQBlock; ++b) {
    const float* xb = x + b * kQBlock;
    float amax = 0.0f;
    for (int j = 0; j < kQBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < kQBlock; ++j) {
      const int v = std::min(32767, std::max(-32767, int(std::nearbyint(xb[j] * inv))));
      q[b * kQBlock + j] = int16_t(v);
      sum += v;
    }
    d[b] = amax / 32767.0f;
    s[b] = d[b] * float(sum);
  }
}

#if defined(TANDEM_QUANT_SCALAR)

void dequantize_row(const uint8_t* w, QType type, int64_t k, float* out) {
  const int64_t bytes = qblock_bytes(int(type));
  for (int64_t b = 0; b < k / kQBlock; ++b, w += bytes, out += kQBlock) {
    const float d = load_half(w);
    if (type == QType::q8_0) {
      const int8_t* qs = reinterpret_cast<const int8_t*>(w + 2);
      for (int j = 0; j < 32; ++j) out[j] = float(qs[j]) * d;
      continue;
    }
    const float m = type == QType::q4_1 ? load_half(w + 2) : -8.0f * d;  // Q4_0: (q − 8)·d = q·d − 8d
    const uint8_t* qs = w + (type == QType::q4_1 ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      out[j] = float(qs[j] & 0x0f) * d + m;
      out[j + 16] = float(qs[j] >> 4) * d + m;
    }
  }
}

template <QType TY>
void rows_group(const QuantMatmulProblem& P, const QuantActs& A, int64_t t0, int nt, int64_t r0, int64_t r1) {
  const int64_t nb = P.k / kQBlock, bytes = qblock_bytes(int(TY));
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = P.w + r * P.w_row_bytes;
    for (int t = 0; t < nt; ++t) {
      const int16_t* a = A.q + (t0 + t) * P.k;
      const float* ad = A.d + (t0 + t) * nb;
      const float* as = A.s + (t0 + t) * nb;
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * bytes;
        const int16_t* ab = a + b * kQBlock;
        const float d = load_half(blk);
        int32_t dot = 0;
        if constexpr (TY == QType::q8_0) {
          const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
          for (int j = 0; j < 32; ++j) dot += int32_t(qs[j]) * ab[j];
          acc += float(dot) * d * ad[b];
        } else {
          const uint8_t* qs = blk + (TY == QType::q4_1 ? 4 : 2);
          for (int j = 0; j < 16; ++j) dot += int32_t(qs[j] & 0x0f) * ab[j] + int32_t(qs[j] >> 4) * ab[j + 16];
          const float c = TY == QType::q4_1 ? load_half(blk + 2) : -8.0f * d;
          acc += float(dot) * d * ad[b] + c * as[b];
        }
      }
      P.y[(t0 + t) * P.y_stride + r] = acc;
    }
  }
}

#else  // x86 vectors

// 16 bytes of nibbles → 32 unsigned bytes: the low nibbles (weights 0…15) then the high ones (16…31).
TANDEM_ALWAYS_INLINE __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low4 = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(raw, low4));
}

#if defined(TANDEM_QUANT_AVX512)
using WVec = __m512i;  // a block's 32 weights as int16
using FVec = __m512;

template <QType TY> TANDEM_ALWAYS_INLINE WVec load_weights(const uint8_t* blk) {
  if constexpr (TY == QType::q8_0)
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)));
  else
    return _mm512_cvtepu8_epi16(unpack_nibbles(blk + (TY == QType::q4_1 ? 4 : 2)));
}
TANDEM_ALWAYS_INLINE FVec block_dot(WVec w, const int16_t* a) {  // exact: |w| ≤ 128, |a| ≤ 32767
  return _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(a)));
}
TANDEM_ALWAYS_INLINE FVec fzero() { return _mm512_setzero_ps(); }
TANDEM_ALWAYS_INLINE FVec fmadd(FVec a, float b, FVec c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), c); }
TANDEM_ALWAYS_INLINE float hsum(FVec v) { return _mm512_reduce_add_ps(v); }

#else  // AVX2: a block as two halves of 16 int16
struct WVec { __m256i lo, hi; };
using FVec = __m256;

template <QType TY> TANDEM_ALWAYS_INLINE WVec load_weights(const uint8_t* blk) {
  if constexpr (TY == QType::q8_0) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1))};
  } else {
    const __m256i raw = unpack_nibbles(blk + (TY == QType::q4_1 ? 4 : 2));
    return {_mm256_cvtepu8_epi16(_mm256_castsi256_si128(raw)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(raw, 1))};
  }
}
TANDEM_ALWAYS_INLINE FVec block_dot(const WVec& w, const int16_t* a) {
  const __m256i lo = _mm256_madd_epi16(w.lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  const __m256i hi = _mm256_madd_epi16(w.hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16)));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
}
TANDEM_ALWAYS_INLINE FVec fzero() { return _mm256_setzero_ps(); }
TANDEM_ALWAYS_INLINE FVec fmadd(FVec a, float b, FVec c) { return _mm256_fmadd_ps(a, _mm256_set1_ps(b), c); }
TANDEM_ALWAYS_INLINE float hsum(FVec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(TANDEM_QUANT_AVX512)
TANDEM_ALWAYS_INLINE void store_block(float* out, WVec w, float d, float m) {
  const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w, 1)));
  _mm512_storeu_ps(out, _mm512_fmadd_ps(lo, vd, vm));
  _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(hi, vd, vm));
}
#else
TANDEM_ALWAYS_INLINE void store_block(float* out, const WVec& w, float d, float m) {
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  const __m256i parts[2] = {w.lo, w.hi};
  for (int h = 0; h < 2; ++h) {
    const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(parts[h])));
    const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(parts[h], 1)));
    _mm256_storeu_ps(out + 16 * h, _mm256_fmadd_ps(a, vd, vm));
    _mm256_storeu_ps(out + 16 * h + 8, _mm256_fmadd_ps(b, vd, vm));
  }
}
#endif

// Bit for bit the scalar dequantize_row's values (and gguf's): q·d is exact in fp32 (an integer of ≤ 8 bits
// times an fp16 value), so the FMA's one rounding is the plain loop's multiply-then-add's.
template <QType TY> void dequantize_row_t(const uint8_t* w, int64_t k, float* out) {
  const int64_t bytes = qblock_bytes(int(TY));
  for (int64_t b = 0; b < k / kQBlock; ++b, w += bytes, out += kQBlock) {
    const float d = load_half(w);
    const float m = TY == QType::q8_0 ? 0.0f : TY == QType::q4_1 ? load_half(w + 2) : -8.0f * d;
    store_block(out, load_weights<TY>(w), d, m);
  }
}

void dequantize_row(const uint8_t* w, QType type, int64_t k, float* out) {
  switch (type) {
    case QType::q4_0: return dequantize_row_t<QType::q4_0>(w, k, out);
    case QType::q4_1: return dequantize_row_t<QType::q4_1>(w, k, out);
    case QType::q8_0: return dequantize_row_t<QType::q8_0>(w, k, out);
  }
}

// NT tokens from t0 over rows [r0, r1), R rows at a time: every (row, token) pair has its own FMA chain,
// and at one token a single chain waits on its FMA's latency every block (4 cycles on Zen 4, for ~10
// instructions of work), so one token takes 4 rows and two tokens 2: 4 independent chains either way.
// Q4's nibbles are read as unsigned 0…15; their offset (−8·d for Q4_0, m for Q4_1) is added once per
// block from the activation sums: c · a_d·Σa.
template <QType TY, int NT, int R>
TANDEM_ALWAYS_INLINE void rows_tile(const QuantMatmulProblem& P, const QuantActs& A, int64_t t0, int64_t r) {
  const int64_t nb = P.k / kQBlock, bytes = qblock_bytes(int(TY));
  const int16_t* a = A.q + t0 * P.k;
  const float* ad = A.d + t0 * nb;
  const float* as = A.s + t0 * nb;
  const uint8_t* row = P.w + r * P.w_row_bytes;
  FVec acc[R][NT];
  float offset[R][NT];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = fzero(), offset[i][t] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = row + i * P.w_row_bytes + b * bytes;
      const float d = load_half(blk);
      const WVec w = load_weights<TY>(blk);
      const float c = TY == QType::q4_1 ? load_half(blk + 2) : -8.0f * d;
      for (int t = 0; t < NT; ++t) {
        acc[i][t] = fmadd(block_dot(w, a + t * P.k + b * kQBlock), d * ad[t * nb + b], acc[i][t]);
        if constexpr (TY != QType::q8_0) offset[i][t] += c * as[t * nb + b];
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) P.y[(t0 + t) * P.y_stride + r + i] = hsum(acc[i][t]) + offset[i][t];
}

template <QType TY, int NT>
void rows_group_n(const QuantMatmulProblem& P, const QuantActs& A, int64_t t0, int64_t r0, int64_t r1) {
  constexpr int R = NT == 1 ? 4 : NT == 2 ? 2 : 1;
  int64_t r = r0;
  for (; r + R <= r1; r += R) rows_tile<TY, NT, R>(P, A, t0, r);
  for (; r < r1; ++r) rows_tile<TY, NT, 1>(P, A, t0, r);
}

template <QType TY>
void rows_group(const QuantMatmulProblem& P, const QuantActs& A, int64_t t0, int nt, int64_t r0, int64_t r1) {
  switch (nt) {
    case 1: return rows_group_n<TY, 1>(P, A, t0, r0, r1);
    case 2: return rows_group_n<TY, 2>(P, A, t0, r0, r1);
    case 3: return rows_group_n<TY, 3>(P, A, t0, r0, r1);
    case 4: return rows_group_n<TY, 4>(P, A, t0, r0, r1);
    default: return;
  }
}

#endif

// Rows in chunks of kRowChunk so that every token group re-reads a chunk's blocks from L1/L2
// (16 rows of the built-in model's down projection: 15 KB) rather than from DRAM.
constexpr int64_t kRowChunk = 16;

template <QType TY>
void matmul_rows_t(const QuantMatmulProblem& P, const QuantActs& A, int64_t r0, int64_t r1) {
  for (int64_t c0 = r0; c0 < r1; c0 += kRowChunk) {
    const int64_t c1 = std::min(r1, c0 + kRowChunk);
    for (int64_t t0 = 0; t0 < P.n_tokens; t0 += kGroup)
      rows_group<TY>(P, A, t0, int(std::min<int64_t>(kGroup, P.n_tokens - t0)), c0, c1);
  }
}

void matmul_rows(const QuantMatmulProblem& P, const QuantActs& A, int64_t r0, int64_t r1) {
  switch (P.type) {
    case QType::q4_0: return matmul_rows_t<QType::q4_0>(P, A, r0, r1);
    case QType::q4_1: return matmul_rows_t<QType::q4_1>(P, A, r0, r1);
    case QType::q8_0: return matmul_rows_t<QType::q8_0>(P, A, r0, r1);
  }
}
