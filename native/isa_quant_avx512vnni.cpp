// Quantised-block kernels for AVX-512 with VNNI (Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4 and
// later): the AVX-512 kernels again, with vpdpwssd adding each vpmaddwd's pairs into the running sums
// in one instruction (quant_vectors.h's madd_add). Compiled for that ISA by the target pragma below, in
// an anonymous namespace like the other ISA files; quant_dispatch.cpp reads the table after checking
// the CPU.
#include "common.h"

#if defined(TANDEM_X86_KERNELS)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "convert.h"
#include "quant_blocks.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
// GCC 12's own _mm512_undefined_ps() trips -Wuninitialized inside its intrinsics (fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#endif

namespace tandem {
namespace {
#define TANDEM_QUANT_AVX512 1
#define TANDEM_QUANT_VNNI 1
#include "quant_kernels.h"
}  // namespace

const QuantKernelTable kQuantTableAvx512Vnni = {"avx512vnni", &quantize_acts, &quantize_acts8, &matmul_rows,
                                               &dequantize_row, &dequantize_row_bf16, &interleaved_rows};
}  // namespace tandem

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif  // TANDEM_X86_KERNELS
