// Quantised-block kernels for AVX-512 F/BW (Skylake-SP and later, Zen 4): a block per 512-bit vpmaddwd.
// Compiled for that ISA by the target pragma below, in an anonymous namespace like the other ISA
// files; quant_dispatch.cpp reads the table after checking the CPU.
#include "common.h"

#if defined(TANDEM_X86_KERNELS)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "convert.h"
#include "quant_blocks.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
// GCC 12's own _mm512_undefined_ps() trips -Wuninitialized inside its intrinsics (fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif

namespace tandem {
namespace {
#define TANDEM_QUANT_AVX512 1
#include "quant_kernels.h"
}  // namespace

const QuantKernelTable kQuantTableAvx512 = {"avx512", &quantize_acts, &quantize_acts8, &matmul_rows, &dequantize_row,
                                           &dequantize_row_bf16, &interleaved_rows};
}  // namespace tandem

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // TANDEM_X86_KERNELS
