// Quantised-block kernels for AVX2 + FMA + F16C (Haswell / Zen 1 and later): vpmaddwd dots over two 256-bit halves,
// and for the K-quants vpmaddubsw over u8 weights and int8 activations (kquant_kernels.h's ksuper_tile_i8).
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
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif

namespace tandem {
namespace {
#define TANDEM_QUANT_AVX2 1
#include "quant_kernels.h"
}  // namespace

const QuantKernelTable kQuantTableAvx2 = {"avx2", &quantize_acts, &quantize_acts8, &matmul_rows, &dequantize_row,
                                           &dequantize_row_bf16, nullptr};
}  // namespace tandem

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // TANDEM_X86_KERNELS
