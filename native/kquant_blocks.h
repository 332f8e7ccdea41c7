// The K-quant super-block layouts (256 weights; ggml's Q4_K, Q5_K, Q6_K as GGUF stores them) and how
// the kernels read one as sub-blocks of 32 weights against the per-32 activation blocks.
//
//   Q4_K  144 bytes: d (fp16), dmin (fp16), scales[12], qs[128]
//   Q5_K  176 bytes: d, dmin, scales[12], qh[32], qs[128]
//   Q6_K  210 bytes: ql[128], qh[64], sc[16] (int8), d (fp16, last)
//
// Q4_K / Q5_K: sub-block j (weights 32j … 32j+31) has a 6-bit scale sc_j and a 6-bit min m_j packed in
// `scales` (kscale_min below); w = (d·sc_j)·q − dmin·m_j with q = the nibbles of qs[32·(j/2) + l] (low
// nibble for even j, high for odd), plus for Q5_K bit j of qh[l] as the fifth bit (l = 0 … 31).
// To the kernels that is a 32-block of small unsigned q with scale s = d·sc_j and offset c = −dmin·m_j:
// Q4_1's shape with integer per-sub-block factors.
//
// Q6_K: two 128-weight halves h; sub-block j = 4h + p (p = 0 … 3) takes its low 4 bits from
// ql[64h + 32·(p&1) + l] (low nibble for p < 2, high for p ≥ 2) and its top 2 bits from
// qh[32h + l] >> 2p; w = d·sc[2j + l/16]·(q − 32). Two scales per 32 weights, so the kernels fold the
// int8 scale into the weight: q' = (q − 32)·sc, |q'| ≤ 32·128 = 4096 (int16), s = d, no offset.
//
// Every value is exact in fp32 before the one rounding gguf's dequantisation also makes: d·sc is an
// 11-bit mantissa times ≤ 8 bits, times q (≤ 6 bits) stays within fp32's 24; only Q4_K/Q5_K's "− dmin·m"
// rounds, once, as an FMA does.
#pragma once

#include <cstdint>

namespace tandem {

constexpr int kKSub = 8;  // 32-weight sub-blocks per super-block

// Byte offsets inside a super-block.
constexpr int kQ4kScales = 4, kQ4kQs = 16;               // Q4_K: after d, dmin; nibbles after 12 bytes of scales
constexpr int kQ5kScales = 4, kQ5kQh = 16, kQ5kQs = 48;  // Q5_K
constexpr int kQ6kQl = 0, kQ6kQh = 128, kQ6kSc = 192, kQ6kD = 208;

// Q4_K/Q5_K's 6-bit scale and min of sub-block j: j < 4 in the low 6 bits of bytes j and j+4; j ≥ 4
// from byte j+4's nibbles (scale low, min high) with the top two bits in bytes j−4 and j.
inline void kscale_min(const uint8_t* scales, int j, int& sc, int& m) {
  if (j < 4) {
    sc = scales[j] & 63;
    m = scales[j + 4] & 63;
  } else {
    sc = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4);
    m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
  }
}

}  // namespace tandem
