// The few vector operations the quantised-block kernels are written in, one set per instruction set
// (included by quant_kernels.h, inside its ISA's target pragma and anonymous namespace):
//
//   Bytes  32 unsigned bytes, a sub-block's small integers q as they are unpacked from the blocks
//   WVec   the same 32 weights as int16 (what vpmaddwd takes)
//   FVec   float lanes of a running dot product (one lane for the scalar set)
//
// A type's decoder (quant_kernels.h, kquant_kernels.h) is written once in these operations; only this
// file differs between AVX-512, AVX2 and the scalar loops.

#if defined(TANDEM_QUANT_SCALAR)

struct Bytes { uint8_t b[32]; };
struct WVec { int16_t v[32]; };
using FVec = float;

TANDEM_ALWAYS_INLINE Bytes load_bytes(const uint8_t* p) {
  Bytes r;
  std::memcpy(r.b, p, 32);
  return r;
}
// 16 bytes of nibbles → the low nibbles (weights 0…15), then the high ones (16…31).
TANDEM_ALWAYS_INLINE Bytes nibbles16(const uint8_t* qs) {
  Bytes r;
  for (int j = 0; j < 16; ++j) r.b[j] = qs[j] & 0x0f, r.b[j + 16] = qs[j] >> 4;
  return r;
}
// (v >> shift) & mask in every byte.
TANDEM_ALWAYS_INLINE Bytes field(const Bytes& v, int shift, uint8_t mask) {
  Bytes r;
  for (int j = 0; j < 32; ++j) r.b[j] = uint8_t((v.b[j] >> shift) & mask);
  return r;
}
// a | b << 4 in every byte (b's values < 16): a fifth or sixth bit on top of a nibble.
TANDEM_ALWAYS_INLINE Bytes or_high(const Bytes& a, const Bytes& b) {
  Bytes r;
  for (int j = 0; j < 32; ++j) r.b[j] = uint8_t(a.b[j] | (b.b[j] << 4));
  return r;
}
// Byte i = bit i of `bits` (0 or 1).
TANDEM_ALWAYS_INLINE Bytes bit_bytes(uint32_t bits) {
  Bytes r;
  for (int j = 0; j < 32; ++j) r.b[j] = uint8_t((bits >> j) & 1u);
  return r;
}
// Byte j = table[idx[j]] (idx < 16): a 4-bit code's value, as int8 bits (MXFP4's E2M1 codes).
TANDEM_ALWAYS_INLINE Bytes lookup16(const Bytes& idx, const int8_t* table) {
  Bytes r;
  for (int j = 0; j < 32; ++j) r.b[j] = uint8_t(table[idx.b[j]]);
  return r;
}
TANDEM_ALWAYS_INLINE WVec widen_u8(const Bytes& v) {
  WVec w;
  for (int j = 0; j < 32; ++j) w.v[j] = int16_t(v.b[j]);
  return w;
}
TANDEM_ALWAYS_INLINE WVec widen_i8(const Bytes& v) {
  WVec w;
  for (int j = 0; j < 32; ++j) w.v[j] = int16_t(int8_t(v.b[j]));
  return w;
}
TANDEM_ALWAYS_INLINE WVec load_i8(const uint8_t* p) {
  WVec w;
  for (int j = 0; j < 32; ++j) w.v[j] = int16_t(int8_t(p[j]));
  return w;
}
// (w − centre)·sc0 for weights 0…15, ·sc1 for 16…31 (Q6_K's two scales a sub-block).
TANDEM_ALWAYS_INLINE WVec centre_scale(const WVec& w, int centre, int sc0, int sc1) {
  WVec r;
  for (int j = 0; j < 32; ++j) r.v[j] = int16_t((w.v[j] - centre) * (j < 16 ? sc0 : sc1));
  return r;
}
TANDEM_ALWAYS_INLINE FVec block_dot(const WVec& w, const int16_t* a) {
  int64_t dot = 0;  // 32 of Q6_K's |q'| ≤ 4096 times 32767 can pass int32
  for (int j = 0; j < 32; ++j) dot += int32_t(w.v[j]) * a[j];
  return float(dot);
}
TANDEM_ALWAYS_INLINE FVec fzero() { return 0.0f; }
TANDEM_ALWAYS_INLINE FVec fmadd(FVec a, float b, FVec c) { return a * b + c; }
TANDEM_ALWAYS_INLINE float hsum(FVec v) { return v; }
// out[j] = q[j]·s + c: q·s is exact (quant_blocks.h), so this rounds once, as gguf does.
TANDEM_ALWAYS_INLINE void store_block(float* out, const WVec& w, float s, float c) {
  for (int j = 0; j < 32; ++j) out[j] = float(w.v[j]) * s + c;
}

#else  // x86: Bytes in one 256-bit register

using Bytes = __m256i;

TANDEM_ALWAYS_INLINE Bytes load_bytes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
TANDEM_ALWAYS_INLINE Bytes nibbles16(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low4 = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(raw, low4));
}
// 16-bit shifts: the bits that come in from the neighbouring byte sit above `mask` (mask ≤ 0xff >> shift).
TANDEM_ALWAYS_INLINE Bytes field(Bytes v, int shift, uint8_t mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(char(mask)));
}
TANDEM_ALWAYS_INLINE Bytes or_high(Bytes a, Bytes b) { return _mm256_or_si256(a, _mm256_slli_epi16(b, 4)); }
TANDEM_ALWAYS_INLINE Bytes bit_bytes(uint32_t bits) {
#if defined(TANDEM_QUANT_AVX512)
  return _mm256_maskz_mov_epi8(__mmask32(bits), _mm256_set1_epi8(1));  // AVX-512 BW + VL: bits as a byte mask
#else
  // byte i gets byte i/8 of `bits` (the shuffle works per 128-bit lane, and each lane holds all four)
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));  // byte i tests bit i % 8
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(1));
#endif
}

// pshufb looks up within each 128-bit lane, so both lanes hold the 16-byte table.
TANDEM_ALWAYS_INLINE Bytes lookup16(Bytes idx, const int8_t* table) {
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))), idx);
}

#if defined(TANDEM_QUANT_AVX512)
using WVec = __m512i;  // a block's 32 weights as int16
using FVec = __m512;

TANDEM_ALWAYS_INLINE WVec widen_u8(Bytes v) { return _mm512_cvtepu8_epi16(v); }
TANDEM_ALWAYS_INLINE WVec widen_i8(Bytes v) { return _mm512_cvtepi8_epi16(v); }
TANDEM_ALWAYS_INLINE WVec load_i8(const uint8_t* p) { return _mm512_cvtepi8_epi16(load_bytes(p)); }
TANDEM_ALWAYS_INLINE WVec centre_scale(WVec w, int centre, int sc0, int sc1) {
  const __m512i sc = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(int16_t(sc0))),
                                        _mm256_set1_epi16(int16_t(sc1)), 1);
  return _mm512_mullo_epi16(_mm512_sub_epi16(w, _mm512_set1_epi16(int16_t(centre))), sc);
}
// The int32 lanes are exact (two products of |w| ≤ 4096, |a| ≤ 32767); their float conversion is too
// while |w| ≤ 128 (every type but Q6_K, whose lanes can pass 2^24 and round by 2^-24 of themselves).
TANDEM_ALWAYS_INLINE FVec block_dot(WVec w, const int16_t* a) {
  return _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(a)));
}
TANDEM_ALWAYS_INLINE FVec fzero() { return _mm512_setzero_ps(); }
TANDEM_ALWAYS_INLINE FVec fmadd(FVec a, float b, FVec c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), c); }
TANDEM_ALWAYS_INLINE float hsum(FVec v) { return _mm512_reduce_add_ps(v); }
// q·s is exact (quant_blocks.h), so the FMA's one rounding is the plain multiply-then-add's (gguf's).
TANDEM_ALWAYS_INLINE void store_block(float* out, WVec w, float s, float c) {
  const __m512 vs = _mm512_set1_ps(s), vc = _mm512_set1_ps(c);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w, 1)));
  _mm512_storeu_ps(out, _mm512_fmadd_ps(lo, vs, vc));
  _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(hi, vs, vc));
}

#else  // AVX2: a block as two halves of 16 int16
struct WVec { __m256i lo, hi; };
using FVec = __m256;

TANDEM_ALWAYS_INLINE WVec widen_u8(Bytes v) {
  return {_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1))};
}
TANDEM_ALWAYS_INLINE WVec widen_i8(Bytes v) {
  return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1))};
}
TANDEM_ALWAYS_INLINE WVec load_i8(const uint8_t* p) { return widen_i8(load_bytes(p)); }
TANDEM_ALWAYS_INLINE WVec centre_scale(const WVec& w, int centre, int sc0, int sc1) {
  const __m256i c = _mm256_set1_epi16(int16_t(centre));
  return {_mm256_mullo_epi16(_mm256_sub_epi16(w.lo, c), _mm256_set1_epi16(int16_t(sc0))),
          _mm256_mullo_epi16(_mm256_sub_epi16(w.hi, c), _mm256_set1_epi16(int16_t(sc1)))};
}
// The int32 lanes are exact (four products, < 2^31); their conversion as in the AVX-512 set.
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
TANDEM_ALWAYS_INLINE void store_block(float* out, const WVec& w, float s, float c) {
  const __m256 vs = _mm256_set1_ps(s), vc = _mm256_set1_ps(c);
  const __m256i parts[2] = {w.lo, w.hi};
  for (int h = 0; h < 2; ++h) {
    const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(parts[h])));
    const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(parts[h], 1)));
    _mm256_storeu_ps(out + 16 * h, _mm256_fmadd_ps(a, vs, vc));
    _mm256_storeu_ps(out + 16 * h + 8, _mm256_fmadd_ps(b, vs, vc));
  }
}
#endif
#endif
