// MLA decode kernel for AVX-512 F/BW/VL/DQ (Skylake-SP and later; the avx512bf16 and amx-bf16 ISAs run it too).
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
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
// GCC 12's own _mm512_undefined_ps() trips -Wuninitialized inside its intrinsics (fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

namespace tandem {
namespace {
#include "simd_avx512.h"
#include "attention_mla_kernel.h"
}  // namespace

const MlaKernelTable kMlaTableAvx512 = {"avx512", &mla_item};
}  // namespace tandem

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // TANDEM_X86_KERNELS
