// The few vector operations the quantised-block kernels are written in, one set per instruction set
// (included by quant_kernels.h, inside its ISA's target pragma and anonymous namespace):
//
//   Bytes  32 unsigned bytes, a sub-block's small integers q as they are unpacked from the blocks
//   WVec   the same 32 weights as int16 (what vpmaddwd takes)
//   FVec   float lanes of a running dot product (one lane for the scalar set)
//   F8     8 floats: a K-quant super-block's per-sub-block factors (kquant_kernels.h)
//   Sc16   Q6_K's 16 int8 scales of a super-block, held for picking each sub-block's pair
//
// A type's decoder (quant_kernels.h, kquant_kernels.h) is written once in these operations; only this
// file differs between AVX-512, AVX2 and the scalar loops. The K-quants' int8 products have their own
// operations, in quant_int8_vectors.h.

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
TANDEM_ALWAYS_INLINE WVec load_u8(const uint8_t* p) { return widen_u8(load_bytes(p)); }
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
// The same values rounded to bf16 (nearest even): the prefill tiles of routed experts.
TANDEM_ALWAYS_INLINE void store_block_bf16(uint16_t* out, const WVec& w, float s, float c) {
  for (int j = 0; j < 32; ++j) out[j] = f32_to_bf16(float(w.v[j]) * s + c);
}

// The 32 bytes at p → their low nibbles (lo) and high nibbles (hi) as 32 words each: one widening for both.
TANDEM_ALWAYS_INLINE void widen_nibbles(const uint8_t* p, WVec& lo, WVec& hi) {
  const Bytes q = load_bytes(p);
  for (int j = 0; j < 32; ++j) lo.v[j] = int16_t(q.b[j] & 0x0f), hi.v[j] = int16_t(q.b[j] >> 4);
}
// Word shifts of small non-negative integers (the K-quants' bit fields after widening).
TANDEM_ALWAYS_INLINE WVec shift16(const WVec& w, int left) {
  WVec r;
  for (int j = 0; j < 32; ++j) r.v[j] = int16_t(left >= 0 ? w.v[j] << left : w.v[j] >> -left);
  return r;
}
// a | (b & mask) in every word.
TANDEM_ALWAYS_INLINE WVec or_masked(const WVec& a, const WVec& b, int16_t mask) {
  WVec r;
  for (int j = 0; j < 32; ++j) r.v[j] = int16_t(a.v[j] | (b.v[j] & mask));
  return r;
}
// Nothing to keep the compiler from: the scalar loops read the factors however they like.
TANDEM_ALWAYS_INLINE void factors_in_memory(const float*) {}

// -- the K-quants' per-super-block factors: 8 floats, one per 32-weight sub-block --
struct F8 { float v[8]; };
TANDEM_ALWAYS_INLINE F8 f8_load(const float* p) {
  F8 r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
TANDEM_ALWAYS_INLINE void f8_store(float* p, const F8& a) { std::memcpy(p, a.v, sizeof a.v); }
TANDEM_ALWAYS_INLINE F8 f8_set1(float x) {
  F8 r;
  for (float& v : r.v) v = x;
  return r;
}
TANDEM_ALWAYS_INLINE F8 f8_mul(const F8& a, const F8& b) {
  F8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = a.v[j] * b.v[j];
  return r;
}
TANDEM_ALWAYS_INLINE F8 f8_fmadd(const F8& a, const F8& b, const F8& c) {
  F8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = std::fma(a.v[j], b.v[j], c.v[j]);
  return r;
}
TANDEM_ALWAYS_INLINE float f8_hsum(const F8& a) {
  float s = 0.0f;
  for (float v : a.v) s += v;
  return s;
}
// Q4_K/Q5_K's 12 bytes of packed scales (kquant_blocks.h) → the 8 sub-blocks' scales and mins as floats.
TANDEM_ALWAYS_INLINE void kscales8(const uint8_t* scales, F8& sc, F8& m) {
  for (int j = 0; j < 8; ++j) {
    int s, mm;
    kscale_min(scales, j, s, mm);
    sc.v[j] = float(s), m.v[j] = float(mm);
  }
}
// Q6_K's 16 int8 scales; centre_scale_pair scales sub-block j by its two (weights 0…15, 16…31).
using Sc16 = const int8_t*;
TANDEM_ALWAYS_INLINE Sc16 load_sc16(const int8_t* sc) { return sc; }
TANDEM_ALWAYS_INLINE WVec centre_scale_pair(const WVec& w, int centre, Sc16 sc, int j) {
  return centre_scale(w, centre, sc[2 * j], sc[2 * j + 1]);
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

// The tile loop broadcasts each sub-block's factor from the array it stored (a load-port broadcast);
// left to itself the compiler keeps the array in a register and spends two shuffle-port µops a
// sub-block picking and broadcasting lanes, on the port the widening already needs. The empty asm
// with the array's address makes its reads go to memory.
TANDEM_ALWAYS_INLINE void factors_in_memory(const float* f) { asm volatile("" : : "r"(f) : "memory"); }

// -- the K-quants' per-super-block factors: 8 floats, one per 32-weight sub-block (AVX2 and AVX-512) --
using F8 = __m256;
TANDEM_ALWAYS_INLINE F8 f8_load(const float* p) { return _mm256_loadu_ps(p); }
TANDEM_ALWAYS_INLINE void f8_store(float* p, F8 a) { _mm256_storeu_ps(p, a); }
TANDEM_ALWAYS_INLINE F8 f8_set1(float x) { return _mm256_set1_ps(x); }
TANDEM_ALWAYS_INLINE F8 f8_mul(F8 a, F8 b) { return _mm256_mul_ps(a, b); }
TANDEM_ALWAYS_INLINE F8 f8_fmadd(F8 a, F8 b, F8 c) { return _mm256_fmadd_ps(a, b, c); }
TANDEM_ALWAYS_INLINE float f8_hsum(F8 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// Q4_K/Q5_K's 12 bytes of packed scales → the 8 sub-blocks' scales and mins as floats, in 32-bit
// lanes of u0, u1, u2 (bytes 0–3, 4–7, 8–11; kquant_blocks.h has the layout):
//   scales 0–3 = u0 & 63, 4–7 = (u2 & 15) | (u0 >> 6 & 3) << 4;  mins 0–3 = u1 & 63, 4–7 = (u2 >> 4 & 15) | (u1 >> 6 & 3) << 4
// ((u >> 6 & 3) << 4 per byte is u >> 2 & 0x30: the bits that shift in from the next byte are masked.)
// Reads 16 bytes: the 4 after the scales are the block's own quants.
// kscale_bytes: bytes 0–7 the scales, 8–15 the mins, as u8; kscales8: the same as floats.
TANDEM_ALWAYS_INLINE __m128i kscale_bytes(const uint8_t* scales) {
  const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales));
  const __m128i low = _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0));   // u0, u2, u1, u2
  const __m128i high = _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0));  // u0, u0, u1, u1
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(low, _mm_setr_epi32(0, 0, 0, 4)),
                                   _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i hi = _mm_and_si128(_mm_srli_epi32(high, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(lo, hi);
}
TANDEM_ALWAYS_INLINE void kscales8(const uint8_t* scales, F8& sc, F8& m) {
  const __m128i both = kscale_bytes(scales);
  sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(both));
  m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(both, both)));
}

#if defined(TANDEM_QUANT_AVX512)
using WVec = __m512i;  // a block's 32 weights as int16
using FVec = __m512;

TANDEM_ALWAYS_INLINE WVec widen_u8(Bytes v) { return _mm512_cvtepu8_epi16(v); }
TANDEM_ALWAYS_INLINE WVec widen_i8(Bytes v) { return _mm512_cvtepi8_epi16(v); }
TANDEM_ALWAYS_INLINE void widen_nibbles(const uint8_t* p, WVec& lo, WVec& hi) {
  const __m512i w = _mm512_cvtepu8_epi16(load_bytes(p));  // upper byte of each word 0: the shift needs no mask
  lo = _mm512_and_si512(w, _mm512_set1_epi16(0x0f)), hi = _mm512_srli_epi16(w, 4);
}
TANDEM_ALWAYS_INLINE WVec shift16(WVec w, int left) {
  return left >= 0 ? _mm512_slli_epi16(w, unsigned(left)) : _mm512_srli_epi16(w, unsigned(-left));
}
TANDEM_ALWAYS_INLINE WVec or_masked(WVec a, WVec b, int16_t mask) {
  return _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi16(mask), 0xf8);  // 0xf8: A | (B & C)
}

TANDEM_ALWAYS_INLINE WVec load_i8(const uint8_t* p) { return _mm512_cvtepi8_epi16(load_bytes(p)); }
TANDEM_ALWAYS_INLINE WVec load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi16(load_bytes(p)); }
TANDEM_ALWAYS_INLINE WVec centre_scale(WVec w, int centre, int sc0, int sc1) {
  const __m512i sc = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(int16_t(sc0))),
                                        _mm256_set1_epi16(int16_t(sc1)), 1);
  return _mm512_mullo_epi16(_mm512_sub_epi16(w, _mm512_set1_epi16(int16_t(centre))), sc);
}
// Q6_K's 16 int8 scales as int16 words; sub-block j's pair (words 2j, 2j+1) spread over its 32
// weights by one vpermw, instead of two broadcasts and an insert per sub-block.
using Sc16 = __m512i;
TANDEM_ALWAYS_INLINE Sc16 load_sc16(const int8_t* sc) {
  return _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))));
}
TANDEM_ALWAYS_INLINE WVec centre_scale_pair(WVec w, int centre, Sc16 sc, int j) {
  const __m512i pick = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(int16_t(2 * j))),
                                          _mm256_set1_epi16(int16_t(2 * j + 1)), 1);  // constant once j is
  return _mm512_mullo_epi16(_mm512_sub_epi16(w, _mm512_set1_epi16(int16_t(centre))), _mm512_permutexvar_epi16(pick, sc));
}
// The int32 lanes are exact (two products of |w| ≤ 4096, |a| ≤ 32767); their float conversion is too
// while |w| ≤ 128 (every type but Q6_K, whose lanes can pass 2^24 and round by 2^-24 of themselves).
TANDEM_ALWAYS_INLINE FVec block_dot(WVec w, const int16_t* a) {
  return _mm512_cvtepi32_ps(_mm512_madd_epi16(w, _mm512_loadu_si512(a)));
}
TANDEM_ALWAYS_INLINE FVec fzero() { return _mm512_setzero_ps(); }
TANDEM_ALWAYS_INLINE FVec fmadd(FVec a, float b, FVec c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), c); }
TANDEM_ALWAYS_INLINE float hsum(FVec v) { return _mm512_reduce_add_ps(v); }
// The block's 32 values q·s + c as two 16-float vectors: q·s is exact (quant_blocks.h), so the FMA's
// one rounding is the plain multiply-then-add's (gguf's).
TANDEM_ALWAYS_INLINE void block_values(WVec w, float s, float c, __m512 v[2]) {
  const __m512 vs = _mm512_set1_ps(s), vc = _mm512_set1_ps(c);
  v[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w))), vs, vc);
  v[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w, 1))), vs, vc);
}
TANDEM_ALWAYS_INLINE void store_block(float* out, WVec w, float s, float c) {
  __m512 v[2];
  block_values(w, s, c, v);
  _mm512_storeu_ps(out, v[0]);
  _mm512_storeu_ps(out + 16, v[1]);
}
// 16 floats → 16 bf16, rounded to nearest even (no NaN comes out of a block: no NaN check).
TANDEM_ALWAYS_INLINE __m256i bf16_of(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
TANDEM_ALWAYS_INLINE void store_block_bf16(uint16_t* out, WVec w, float s, float c) {
  __m512 v[2];
  block_values(w, s, c, v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bf16_of(v[0]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), bf16_of(v[1]));
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
TANDEM_ALWAYS_INLINE WVec load_i8(const uint8_t* p) {  // each half widened straight from memory
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
TANDEM_ALWAYS_INLINE WVec load_u8(const uint8_t* p) {
  return {_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
// A Q4 block's 16 bytes of nibbles → its 32 values: each byte widened to a 16-bit lane straight from
// memory, then its low nibble (weights 0…15) and high nibble (16…31): three instructions where
// nibbles16 + widen_u8 take eight, in a loop that is compute-bound on AVX2.
TANDEM_ALWAYS_INLINE WVec nibbles_wide(const uint8_t* qs) {
  const __m256i raw = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return {_mm256_and_si256(raw, _mm256_set1_epi16(0x0f)), _mm256_srli_epi16(raw, 4)};
}
TANDEM_ALWAYS_INLINE void widen_nibbles(const uint8_t* p, WVec& lo, WVec& hi) {
  const WVec w = load_u8(p);
  const __m256i low4 = _mm256_set1_epi16(0x0f);
  lo = {_mm256_and_si256(w.lo, low4), _mm256_and_si256(w.hi, low4)};
  hi = {_mm256_srli_epi16(w.lo, 4), _mm256_srli_epi16(w.hi, 4)};
}
TANDEM_ALWAYS_INLINE WVec shift16(const WVec& w, int left) {
  if (left >= 0) return {_mm256_slli_epi16(w.lo, left), _mm256_slli_epi16(w.hi, left)};
  return {_mm256_srli_epi16(w.lo, -left), _mm256_srli_epi16(w.hi, -left)};
}
TANDEM_ALWAYS_INLINE WVec or_masked(const WVec& a, const WVec& b, int16_t mask) {
  const __m256i m = _mm256_set1_epi16(mask);
  return {_mm256_or_si256(a.lo, _mm256_and_si256(b.lo, m)), _mm256_or_si256(a.hi, _mm256_and_si256(b.hi, m))};
}

TANDEM_ALWAYS_INLINE WVec centre_scale(const WVec& w, int centre, int sc0, int sc1) {
  const __m256i c = _mm256_set1_epi16(int16_t(centre));
  return {_mm256_mullo_epi16(_mm256_sub_epi16(w.lo, c), _mm256_set1_epi16(int16_t(sc0))),
          _mm256_mullo_epi16(_mm256_sub_epi16(w.hi, c), _mm256_set1_epi16(int16_t(sc1)))};
}
using Sc16 = const int8_t*;  // Q6_K's scales: two broadcasts a sub-block
TANDEM_ALWAYS_INLINE Sc16 load_sc16(const int8_t* sc) { return sc; }
TANDEM_ALWAYS_INLINE WVec centre_scale_pair(const WVec& w, int centre, Sc16 sc, int j) {
  return centre_scale(w, centre, sc[2 * j], sc[2 * j + 1]);
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
// The block's 32 values q·s + c as four 8-float vectors (one rounding each, as gguf's).
TANDEM_ALWAYS_INLINE void block_values(const WVec& w, float s, float c, __m256 v[4]) {
  const __m256 vs = _mm256_set1_ps(s), vc = _mm256_set1_ps(c);
  const __m256i parts[2] = {w.lo, w.hi};
  for (int h = 0; h < 2; ++h) {
    v[2 * h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(parts[h]))), vs, vc);
    v[2 * h + 1] =
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(parts[h], 1))), vs, vc);
  }
}
TANDEM_ALWAYS_INLINE void store_block(float* out, const WVec& w, float s, float c) {
  __m256 v[4];
  block_values(w, s, c, v);
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, v[i]);
}
// 8 floats → their bf16 bit patterns in 32-bit lanes, rounded to nearest even (no NaN from a block).
TANDEM_ALWAYS_INLINE __m256i bf16_lanes(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
}
TANDEM_ALWAYS_INLINE void store_block_bf16(uint16_t* out, const WVec& w, float s, float c) {
  __m256 v[4];
  block_values(w, s, c, v);
  for (int h = 0; h < 2; ++h) {
    // packus works per 128-bit lane (a0-3 b0-3 a4-7 b4-7): the permute puts the words back in order
    const __m256i packed = _mm256_packus_epi32(bf16_lanes(v[2 * h]), bf16_lanes(v[2 * h + 1]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * h), _mm256_permute4x64_epi64(packed, 0xD8));
  }
}


#endif
#endif

#if !defined(TANDEM_QUANT_AVX2)
// A Q4 block's nibbles as its 32 values (AVX2 has its own, shorter, above).
TANDEM_ALWAYS_INLINE WVec nibbles_wide(const uint8_t* qs) { return widen_u8(nibbles16(qs)); }
#endif
