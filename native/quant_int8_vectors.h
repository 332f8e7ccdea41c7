// The vector operations of the K-quants' int8 products (kquant_kernels.h's ksuper_tile_i8), included by
// quant_kernels.h after quant_vectors.h (whose Bytes, F8 and FVec they use) where TANDEM_QUANT_INT8 is
// defined, inside the including ISA's target pragma and anonymous namespace:
//   I32x8  8 int32 lanes of a super-block's integer sums over int8 activations; AVX2 adds them up
//          with dot_u8s8 (vpmaddubsw, then vpmaddwd by the sub-block's scale words)
//   Pair   (AVX-512) two sub-blocks' 64 u8 weights, one per 256-bit half: dot2_u8s8_add, halves

// -- the K-quants' int8 products (kquant_kernels.h's ksuper_tile_i8), both ISAs: a super-block's mins'
// or centring term, and AVX2's weights' term, as 8 int32 lanes --
using I32x8 = __m256i;
// acc + float(lanes)·f
TANDEM_ALWAYS_INLINE F8 fmadd_i32(I32x8 lanes, float f, F8 acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(f), acc);
}
#if defined(TANDEM_QUANT_AVX512)
// -- the K-quants' int8 products two sub-blocks at a time (kquant_kernels.h's each_pair8) --
using Pair = __m512i;  // sub-block 2p's 32 u8 weights in the low 256 bits, 2p + 1's in the high
// The 32 bytes at p in both halves: the loads the pair's two sub-blocks unpack differently.
TANDEM_ALWAYS_INLINE __m512i both_halves(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// (v >> lo) & mask in every byte of the low half, (v >> hi) & mask in the high half (64-bit shifts:
// what comes in from the neighbouring byte lies above mask, as long as mask ≤ 0xff >> max(lo, hi)).
TANDEM_ALWAYS_INLINE Pair halves(__m512i v, int lo, int hi, uint8_t mask) {
  const __m512i shifts = _mm512_inserti64x4(_mm512_set1_epi64(lo), _mm256_set1_epi64x(hi), 1);
  return _mm512_and_si512(_mm512_srlv_epi64(v, shifts), _mm512_set1_epi8(char(mask)));
}
// a | b << 4 in every byte, b's values below 4 (a fifth, or fifth and sixth, bit above a nibble; the
// 64-bit shift moves nothing across a byte).
TANDEM_ALWAYS_INLINE Pair or_high2(Pair a, __m512i b) { return _mm512_or_si512(a, _mm512_slli_epi64(b, 4)); }
// acc + each pair of words of a times the same pair of b, summed into 16 int32 lanes: vpmaddwd and an
// add, or one vpdpwssd with VNNI.
TANDEM_ALWAYS_INLINE __m512i madd_add(__m512i acc, __m512i a, __m512i b) {
#if defined(TANDEM_QUANT_VNNI)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
// acc + dot_u8s8 over both halves at once: 16 int32 lanes, the low 8 sub-block 2p's, the high 8 2p + 1's.
TANDEM_ALWAYS_INLINE __m512i dot2_u8s8_add(__m512i acc, Pair q, const int8_t* a, __m512i scale) {
  return madd_add(acc, _mm512_maddubs_epi16(q, _mm512_loadu_si512(a)), scale);
}
// Words picked from the 16 in `words` by a 32-word index: a pair's scale words, one per maddubs word.
TANDEM_ALWAYS_INLINE __m512i pick_words2(__m256i words, __m512i index) {
  return _mm512_permutexvar_epi16(index, _mm512_castsi256_si512(words));
}
// acc + float(lanes)·f over a pair's 16 lanes
TANDEM_ALWAYS_INLINE FVec fmadd_i32(__m512i lanes, float f, FVec acc) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_set1_ps(f), acc);
}
#else
// -- AVX2's K-quant int8 products a sub-block at a time: u8 weights × s8 activations --
TANDEM_ALWAYS_INLINE I32x8 i32_zero() { return _mm256_setzero_si256(); }
TANDEM_ALWAYS_INLINE I32x8 i32_add(I32x8 a, I32x8 b) { return _mm256_add_epi32(a, b); }
// 32 weights q (u8, ≤ 63) against 32 activations (s8, |a| ≤ 127): vpmaddubsw sums adjacent pairs to
// int16 (|2·63·128| < 2^15: it never saturates), then vpmaddwd multiplies word i by scale word i
// and sums pairs again: 8 int32 lanes, Σ q·a·scale over the 32 weights.
TANDEM_ALWAYS_INLINE I32x8 dot_u8s8(Bytes q, const int8_t* a, __m256i scale) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))), scale);
}
// Word lo of v's low 128-bit lane in all of that lane, word hi of its high lane in all of it (the
// maddubs words of weights 0…15 sit in the low lane, of 16…31 in the high one).
TANDEM_ALWAYS_INLINE __m256i pick_words(__m256i v, int lo, int hi) {
  return _mm256_shuffle_epi8(v, _mm256_setr_m128i(_mm_set1_epi16(int16_t(0x0100 + 0x0202 * lo)),
                                                  _mm_set1_epi16(int16_t(0x0100 + 0x0202 * hi))));
}
// a | ((v shifted left by `left`, right when negative) & mask) in every byte: a bit field of v moved
// into place above a nibble (16-bit shifts: what comes in from the neighbouring byte lies outside
// mask, as long as mask's bits stay within the shifted field's).
TANDEM_ALWAYS_INLINE Bytes or_shifted(Bytes a, Bytes v, int left, uint8_t mask) {
  const __m256i moved = left >= 0 ? _mm256_slli_epi16(v, left) : _mm256_srli_epi16(v, -left);
  return _mm256_or_si256(a, _mm256_and_si256(moved, _mm256_set1_epi8(char(mask))));
}
#endif
