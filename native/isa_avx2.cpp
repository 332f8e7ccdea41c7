// Kernels for AVX2 + FMA + F16C (Haswell / Zen 1 and later).
// Every function in this file is compiled for that ISA by the target pragma below and lives in an
// anonymous namespace, so no inline copy can be shared with (and leak into) another ISA's code.
// Only the data table at the end is visible; dispatch.cpp reads it after checking the CPU.
#include "common.h"

#if defined(TANDEM_X86_KERNELS)
#include <immintrin.h>

#include "convert.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif

namespace tandem {
namespace {
#include "simd_avx2.h"
#include "attention_kernel.h"
#include "experts_kernel.h"
}  // namespace

const KernelTable kTableAvx2 = {"avx2", &attention_item, &expert_activation_dtype, &expert_tiling,
                             &expert_prepare_x, &expert_gate_up, &expert_down};
}  // namespace tandem

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // TANDEM_X86_KERNELS
