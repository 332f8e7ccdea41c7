// MLA decode kernel for AVX2 + FMA + F16C (Haswell / Zen 1 and later).
// Compiled for that ISA by the target pragma below, in an anonymous namespace like the other ISA files;
// mla_dispatch.cpp reads the table after the per-head kernels' ISA choice.
#include "common.h"

#if defined(TANDEM_X86_KERNELS)
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "attention_mla.h"
#include "convert.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif

namespace tandem {
namespace {
#include "simd_avx2.h"
#include "attention_mla_kernel.h"
}  // namespace

const MlaKernelTable kMlaTableAvx2 = {"avx2", &mla_item};
}  // namespace tandem

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // TANDEM_X86_KERNELS
