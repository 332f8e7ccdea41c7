// The quantised matrix-vector kernels, included by each isa_quant_*.cpp inside its target pragma and
// an anonymous namespace (as the other ISA kernels are). The including file defines one of
//   TANDEM_QUANT_AVX512  a block as one 512-bit vector of 32 int16 weights: vpmaddwd with the
//                        activation block, 16 int32 partial sums (and TANDEM_QUANT_VNNI where the
//                        int32 sums add up in vpdpwssd)
//   TANDEM_QUANT_AVX2    the same as two 256-bit halves
//   TANDEM_QUANT_SCALAR  plain loops
// Activations are quantised per 32-block to int16 (scale a_d = max|x|/32767) and weights widened to
// int16, so a block's dot product is exact in int32 and the only rounding besides fp32's is the
// activation's, 2^-16 of the block's largest value. int8 activations (llama.cpp's vec_dot, vpmaddubsw /
// vpdpbusd) are 256 times coarser: with them the built-in model's greedy answer to the README's
// question changed ("L'Étoile, la Marseillaise …" instead of "The capital of France is Paris."),
// and vpmaddwd takes a block in one 512-bit instruction all the same. Each block's int32 sums become
// float and are scaled by d·a_d into the token's float lanes (one convert, one FMA per block and
// token). The exception: AVX2's and AVX-512's K-quant products read the activations as int8, one scale
// per 256 values (quantize_acts8, kquant_kernels.h's ksuper_tile_i8 says why), as llama.cpp's do.
// Tokens run in groups (group_of) over a chunk of rows, so a row's blocks are unpacked once per group
// and re-read from L1 by the next group.
//
// Every type is read through a decoder, Decode<TY>::at(block, j, s, c): sub-block j's 32 small integers q
// as a WVec and the scale s and offset c with w = q·s + c (quant_blocks.h). The tile loop, the
// dequantisation and the dispatch below are written once over decoders; the vector operations they use
// are in quant_vectors.h, the K-quant decoders in kquant_kernels.h.
//
// Needs quant_blocks.h, kquant_blocks.h and convert.h (f16_to_f32) included before.

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

#if defined(TANDEM_QUANT_AVX2) || defined(TANDEM_QUANT_AVX512)
#define TANDEM_QUANT_INT8 1  // the K-quant products read int8 activations (kquant_kernels.h's ksuper_tile_i8)
// One token's activations → the int8 form the K-quant products read (QuantActs' q8, d8, b8):
// d = max|x|/127 per 256 values (0 for an all-zero one), q = x/d rounded to nearest even (vcvtps2dq
// under the default rounding mode), and Σq over each 16 values.
void quantize_acts8(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < k / kQKBlock; ++b) {
    const float* xb = x + b * kQKBlock;
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < kQKBlock; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xb + j), abs_mask));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    d[b] = amax / 127.0f;
    int8_t* qb = q + b * kQKBlock;
    for (int j = 0; j < kQKBlock; j += 32) {
      __m256i i[4];
      for (int v = 0; v < 4; ++v) i[v] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j + 8 * v), inv));
      // the packs work per 128-bit lane: dwords come out as 0 4 1 5 2 6 3 7 of the wanted order
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + j),
                          _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    for (int g = 0; g < kQKBlock / 16; ++g) {
      int sum = 0;
      for (int j = 0; j < 16; ++j) sum += qb[16 * g + j];
      bsum[b * (kQKBlock / 16) + g] = int16_t(sum);
    }
  }
}
#endif

#include "quant_vectors.h"
#if defined(TANDEM_QUANT_INT8)
#include "quant_int8_vectors.h"
#endif

// -- decoders of the 32-weight types (one sub-block a block) --

template <QType TY> struct Decode;

template <> struct Decode<QType::q4_0> {
  static constexpr int kSub = 1;
  static constexpr bool kOffset = true;
  static TANDEM_ALWAYS_INLINE WVec at(const uint8_t* b, int, float& s, float& c) {
    s = load_half(b), c = -8.0f * s;  // (q − 8)·d = q·d − 8d
    return nibbles_wide(b + 2);
  }
};

template <> struct Decode<QType::q4_1> {
  static constexpr int kSub = 1;
  static constexpr bool kOffset = true;
  static TANDEM_ALWAYS_INLINE WVec at(const uint8_t* b, int, float& s, float& c) {
    s = load_half(b), c = load_half(b + 2);
    return nibbles_wide(b + 4);
  }
};

TANDEM_ALWAYS_INLINE Bytes q5_values(const uint8_t* qh, const uint8_t* qs) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);  // little-endian: bit i is weight i's fifth bit
  return or_high(nibbles16(qs), bit_bytes(bits));
}

template <> struct Decode<QType::q5_0> {
  static constexpr int kSub = 1;
  static constexpr bool kOffset = true;
  static TANDEM_ALWAYS_INLINE WVec at(const uint8_t* b, int, float& s, float& c) {
    s = load_half(b), c = -16.0f * s;
    return widen_u8(q5_values(b + 2, b + 6));
  }
};

template <> struct Decode<QType::q5_1> {
  static constexpr int kSub = 1;
  static constexpr bool kOffset = true;
  static TANDEM_ALWAYS_INLINE WVec at(const uint8_t* b, int, float& s, float& c) {
    s = load_half(b), c = load_half(b + 2);
    return widen_u8(q5_values(b + 4, b + 8));
  }
};

template <> struct Decode<QType::q8_0> {
  static constexpr int kSub = 1;
  static constexpr bool kOffset = false;
  static TANDEM_ALWAYS_INLINE WVec at(const uint8_t* b, int, float& s, float& c) {
    s = load_half(b), c = 0.0f;
    return load_i8(b + 2);
  }
};

// MXFP4 (quant_blocks.h): E2M1 codes as twice their value (bit 3 the sign; the codes 0 and 8 are
// both zero), so they are integers; the block's scale is halved to match.
alignas(16) constexpr int8_t kE2M1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e − 128) from an E8M0 byte, built from its bits: e ≥ 2 is the normal float with biased exponent
// e − 1; e = 0 and 1 (2^-128, 2^-127) are fp32 subnormals, a single mantissa bit 21 or 22.
TANDEM_ALWAYS_INLINE float e8m0_half(uint8_t e) {
  const uint32_t bits = e >= 2 ? uint32_t(e - 1) << 23 : 0x00200000u << e;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <> struct Decode<QType::mxfp4> {
  static constexpr int kSub = 1;
  static constexpr bool kOffset = false;
  static TANDEM_ALWAYS_INLINE WVec at(const uint8_t* b, int, float& s, float& c) {
    s = e8m0_half(b[0]), c = 0.0f;
    return widen_i8(lookup16(nibbles16(b + 1), kE2M1Doubled));
  }
};

#include "kquant_kernels.h"

// -- the loops, over any decoder --

// Out is float (fp32) or uint16_t (bf16 bits).
template <QType TY, class Out> void dequantize_row_t(const uint8_t* w, int64_t k, Out* out) {
  using D = Decode<TY>;
  const int64_t bytes = qblock_bytes(int(TY));
  for (int64_t b = 0; b < k / (kQBlock * D::kSub); ++b, w += bytes) {
    for (int j = 0; j < D::kSub; ++j, out += kQBlock) {
      float s, c;
      const WVec q = D::at(w, j, s, c);
      if constexpr (std::is_same_v<Out, float>)
        store_block(out, q, s, c);
      else
        store_block_bf16(out, q, s, c);
    }
  }
}

// NT tokens from t0 over rows [r, r + R): every (row, token) pair has its own FMA chain, and at one
// token a single chain waits on its FMA's latency every block (4 cycles on Zen 4, for ~10
// instructions of work), so one token takes 4 rows and two tokens 2: 4 independent chains either way.
// The offset c is added once per sub-block from the activation sums: c · a_d·Σa.
template <QType TY, int NT, int R>
TANDEM_ALWAYS_INLINE void rows_tile(const QuantMatmulProblem& P, const QuantActs& A, int64_t t0, int64_t r) {
  using D = Decode<TY>;
  if constexpr (D::kSub == kKSub) {
#if defined(TANDEM_QUANT_INT8)
    ksuper_tile_i8<TY, NT, R>(P, A, t0, r);  // the int8 form (kquant_kernels.h)
#else
    ksuper_tile<TY, NT, R>(P, A, t0, r);
#endif
    return;
  }
  const int64_t nb = P.k / kQBlock, bytes = qblock_bytes(int(TY));
  const int16_t* a = A.q + t0 * P.k;
  const float* ad = A.d + t0 * nb;
  const float* as = A.s + t0 * nb;
  const uint8_t* row = P.w + r * P.w_row_bytes;
  FVec acc[R][NT];
  float offset[R][NT];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = fzero(), offset[i][t] = 0.0f;
  for (int64_t sb = 0; sb < nb / D::kSub; ++sb) {
    for (int j = 0; j < D::kSub; ++j) {
      const int64_t b = sb * D::kSub + j;  // the activations' 32-block
      for (int i = 0; i < R; ++i) {
        float s, c;
#if !defined(TANDEM_QUANT_SCALAR)
        // The next tile's rows at the same place (R rows ahead: 1.4 KB for the built-in model's 576-wide
        // Q4_1 rows): a decode step reads every weight once, from DRAM, and the hardware prefetcher
        // alone left the kernel at 0.6 of its speed on warm weights (1536×576 Q4_1: 130 µs a call
        // in the decode loop against 88 in a loop over the weights; 89 with this).
        _mm_prefetch(reinterpret_cast<const char*>(row + (i + R) * P.w_row_bytes + sb * bytes + j * (bytes / D::kSub)),
                     _MM_HINT_T0);
#endif
        const WVec w = D::at(row + i * P.w_row_bytes + sb * bytes, j, s, c);
        for (int t = 0; t < NT; ++t) {
          acc[i][t] = fmadd(block_dot(w, a + t * P.k + b * kQBlock), s * ad[t * nb + b], acc[i][t]);
          if constexpr (D::kOffset) offset[i][t] += c * as[t * nb + b];
        }
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

// Tokens a group: kGroup, or 8 for AVX-512's int8 K-quant tiles, whose per-(row, super-block) work
// (scales, the weights' unpacking, the prefetches) is then shared by twice the tokens; their 8 sums,
// 8 + 8 accumulators and the pair's weights and scales fit the 32 vector registers.
template <QType TY> constexpr int group_of() {
#if defined(TANDEM_QUANT_AVX512)
  if constexpr (Decode<TY>::kSub == kKSub) return 8;
#endif
  return kGroup;
}

template <QType TY>
void rows_group(const QuantMatmulProblem& P, const QuantActs& A, int64_t t0, int nt, int64_t r0, int64_t r1) {
  switch (nt) {
    case 1: return rows_group_n<TY, 1>(P, A, t0, r0, r1);
    case 2: return rows_group_n<TY, 2>(P, A, t0, r0, r1);
    case 3: return rows_group_n<TY, 3>(P, A, t0, r0, r1);
    case 4: return rows_group_n<TY, 4>(P, A, t0, r0, r1);
    default: break;
  }
  if constexpr (group_of<TY>() == 8) {
    switch (nt) {
      case 5: return rows_group_n<TY, 5>(P, A, t0, r0, r1);
      case 6: return rows_group_n<TY, 6>(P, A, t0, r0, r1);
      case 7: return rows_group_n<TY, 7>(P, A, t0, r0, r1);
      case 8: return rows_group_n<TY, 8>(P, A, t0, r0, r1);
      default: return;
    }
  }
}

// Rows in chunks of kRowChunk so that every token group re-reads a chunk's blocks from L1/L2
// (16 rows of the built-in model's down projection: 15 KB) rather than from DRAM.
constexpr int64_t kRowChunk = 16;

template <QType TY>
void matmul_rows_t(const QuantMatmulProblem& P, const QuantActs& A, int64_t r0, int64_t r1) {
  for (int64_t c0 = r0; c0 < r1; c0 += kRowChunk) {
    const int64_t c1 = std::min(r1, c0 + kRowChunk);
    for (int64_t t0 = 0; t0 < P.n_tokens; t0 += group_of<TY>())
      rows_group<TY>(P, A, t0, int(std::min<int64_t>(group_of<TY>(), P.n_tokens - t0)), c0, c1);
  }
}

// One switch over the types for both entry points: F<TY>::run(args…).
template <template <QType> class F, class... Args> void by_type(QType type, Args&&... args) {
  switch (type) {
    case QType::q4_0: return F<QType::q4_0>::run(args...);
    case QType::q4_1: return F<QType::q4_1>::run(args...);
    case QType::q5_0: return F<QType::q5_0>::run(args...);
    case QType::q5_1: return F<QType::q5_1>::run(args...);
    case QType::q8_0: return F<QType::q8_0>::run(args...);
    case QType::q4_k: return F<QType::q4_k>::run(args...);
    case QType::q5_k: return F<QType::q5_k>::run(args...);
    case QType::q6_k: return F<QType::q6_k>::run(args...);
    case QType::mxfp4: return F<QType::mxfp4>::run(args...);
  }
}
template <QType TY> struct DequantizeRow {
  template <class Out> static void run(const uint8_t* w, int64_t k, Out* out) { dequantize_row_t<TY>(w, k, out); }
};
template <QType TY> struct MatmulRows {
  static void run(const QuantMatmulProblem& P, const QuantActs& A, int64_t r0, int64_t r1) { matmul_rows_t<TY>(P, A, r0, r1); }
};

void dequantize_row(const uint8_t* w, QType type, int64_t k, float* out) { by_type<DequantizeRow>(type, w, k, out); }
void dequantize_row_bf16(const uint8_t* w, QType type, int64_t k, uint16_t* out) {
  by_type<DequantizeRow>(type, w, k, out);
}

void matmul_rows(const QuantMatmulProblem& P, const QuantActs& A, int64_t r0, int64_t r1) {
  by_type<MatmulRows>(P.type, P, A, r0, r1);
}

#if defined(TANDEM_QUANT_AVX512)
// One token over a 16-row interleaved copy (quant_blocks.h's Interleaved16), groups [g0, g1): per
// block, pair j of the 16 rows (16 bytes) widened to dwords whose low word is the pair's first weight
// and high word its second, times the activations' pair j as one broadcast dword (vpmaddwd): 16 rows'
// int32 sums at once, exact as the row kernel's. Per block and 16 rows that is ~30 vector instructions
// where the row kernel spends ~25 on each row's block (unpacking, f16 scales, broadcasts): 960×576
// Q4_1 in 18.6 µs against 54.5 on one AVX-512 core. The scales and offsets are lane vectors:
// acc += dot·(scale·a_d), off += offset·a_s, as the row kernel's terms are.
void interleaved_rows(const QuantMatmulProblem& P, const QuantActs& A, int64_t g0, int64_t g1) {
  const Interleaved16& W = *P.interleaved;
  const int64_t nb = P.k / kQBlock;
  const __m512i low4 = _mm512_set1_epi32(0x0f), high4 = _mm512_set1_epi32(0xf0);
  auto pair = [&](const uint8_t* p) {  // 16 rows' pair bytes → (first | second << 16) dwords
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_or_si512(_mm512_and_si512(d, low4), _mm512_slli_epi32(_mm512_and_si512(d, high4), 12));
  };
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* pairs = W.pairs + g * nb * 256;
    const float* scale = W.scale + g * nb * 16;
    const float* offset = W.offset + g * nb * 16;
    __m512 acc = _mm512_setzero_ps(), off = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, pairs += 256) {
      const int16_t* a = A.q + b * kQBlock;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // two chains: even and odd pairs
      for (int j = 0; j < 16; j += 2) {
        int32_t a0, a1;  // the activations' pairs j and j + 1, each as one dword
        std::memcpy(&a0, a + 2 * j, 4), std::memcpy(&a1, a + 2 * j + 2, 4);
        s0 = madd_add(s0, pair(pairs + 16 * j), _mm512_set1_epi32(a0));
        s1 = madd_add(s1, pair(pairs + 16 * j + 16), _mm512_set1_epi32(a1));
      }
      const __m512 f = _mm512_mul_ps(_mm512_loadu_ps(scale + 16 * b), _mm512_set1_ps(A.d[b]));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), f, acc);
      off = _mm512_fmadd_ps(_mm512_loadu_ps(offset + 16 * b), _mm512_set1_ps(A.s[b]), off);
    }
    _mm512_storeu_ps(P.y + 16 * g, _mm512_add_ps(acc, off));
  }
}
#endif
