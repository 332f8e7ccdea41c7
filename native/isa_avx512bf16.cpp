// Kernels for AVX-512 with VDPBF16PS (Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later).
// Every function in this file is compiled for that ISA by the target pragma below and lives in an
// anonymous namespace, so no inline copy can be shared with (and leak into) another ISA's code.
// Only the data table at the end is visible; dispatch.cpp reads it after checking the CPU.
#include "common.h"

#if defined(TANDEM_AVX512BF16_KERNELS)
#include <immintrin.h>

#include "convert.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"))), apply_to = function)
#else
// GCC 12's own _mm512_undefined_ps() trips -Wuninitialized inside its intrinsics (fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#endif
#define TANDEM_DPBF16 1

namespace tandem {
namespace {
#include "simd_avx512.h"
#include "attention_kernel.h"
#include "experts_kernel.h"
}  // namespace

const KernelTable kTableAvx512Bf16 = {"avx512bf16", &attention_item, &expert_activation_dtype, &expert_tiling,
                             &expert_prepare_x, &expert_gate_up, &expert_down};
}  // namespace tandem

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // TANDEM_AVX512BF16_KERNELS
