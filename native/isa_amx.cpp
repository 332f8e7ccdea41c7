// Kernels for AMX-BF16 (Intel Sapphire Rapids and later): the AVX512_BF16 kernels, plus experts with
// enough tokens on AMX tiles (amx_experts.h). Compiled like isa_avx512bf16.cpp, with the tile
// instructions added to the target; dispatch.cpp chooses this table only after the CPU reports
// AMX and Linux has granted the process its tile state.
#include "common.h"

#if defined(TANDEM_AMX_KERNELS)
#include <immintrin.h>

#include "convert.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16"))), apply_to = function)
#else
// GCC 12's own _mm512_undefined_ps() trips -Wuninitialized inside its intrinsics (fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
#endif
#define TANDEM_DPBF16 1

namespace tandem {
namespace {
#include "simd_avx512.h"
#include "attention_kernel.h"
#include "experts_kernel.h"
#include "amx_experts.h"
}  // namespace

const KernelTable kTableAmxBf16 = {"amx-bf16", &attention_item, &expert_activation_dtype, &amx_tiling,
                                   &amx_or_vector_prepare_x, &amx_or_vector_gate_up, &amx_or_vector_down};
}  // namespace tandem

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // TANDEM_AMX_KERNELS
