// Scalar element conversions (round to nearest even) and element types per DType.
// Included before any target pragma, so these compile for the baseline ISA and inline anywhere.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace tandem {

template <DType D> struct Elem { using type = uint16_t; };  // bf16 and f16 travel as raw bits
template <> struct Elem<DType::f32> { using type = float; };

inline float bits_to_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float bf16_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // NaN stays a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man · 2^-24
    const float v = float(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_f32(sign | 0x7f800000u | (man << 13));  // inf, NaN
  return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_to_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // ≥ 65520 rounds to inf
  if (a < 0x38800000u) {                                  // below 2^-14: subnormal half (or zero)
    return uint16_t(sign | uint32_t(std::nearbyint(bits_to_f32(a) * 16777216.0f)));
  }
  uint32_t r = a - 0x38000000u;  // rebias the exponent from 127 to 15
  r += 0xfffu + ((r >> 13) & 1u);
  return uint16_t(sign | (r >> 13));
}

template <DType D> inline float to_f32(typename Elem<D>::type x) {
  if constexpr (D == DType::f32) return x;
  else if constexpr (D == DType::bf16) return bf16_to_f32(x);
  else return f16_to_f32(x);
}

template <DType D> inline typename Elem<D>::type from_f32(float x) {
  if constexpr (D == DType::f32) return x;
  else if constexpr (D == DType::bf16) return f32_to_bf16(x);
  else return f32_to_f16(x);
}

// Element i of a buffer of runtime dtype d, as fp32 (cold paths only: per-row setup).
inline float load_as_f32(const void* p, DType d, int64_t i) {
  switch (d) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

inline void store_from_f32(void* p, DType d, int64_t i, float x) {
  switch (d) {
    case DType::f32: static_cast<float*>(p)[i] = x; break;
    case DType::bf16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(x); break;
    default: static_cast<uint16_t*>(p)[i] = f32_to_f16(x); break;
  }
}

inline size_t dtype_size(DType d) { return d == DType::f32 ? 4 : 2; }

}  // namespace tandem
