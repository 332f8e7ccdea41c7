// The portable quantised-block kernels: plain loops for the baseline ISA. Always built; chosen when
// no vector ISA is available (or forced by TANDEM_NATIVE_ISA=scalar).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"
#include "convert.h"
#include "quant_blocks.h"

namespace tandem {
namespace {
#define TANDEM_QUANT_SCALAR 1
#include "quant_kernels.h"
}  // namespace

const QuantKernelTable kQuantTableScalar = {"scalar", &quantize_acts, nullptr, &matmul_rows, &dequantize_row,
                                           &dequantize_row_bf16, nullptr};
}  // namespace tandem
