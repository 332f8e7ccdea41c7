// The portable MLA decode kernel: one-lane "vectors", the baseline ISA of the target.
// Compiled for that ISA by the target pragma below, in an anonymous namespace like the other ISA files;
// mla_dispatch.cpp reads the table after the per-head kernels' ISA choice.
#include "common.h"

#include <cmath>
#include <vector>

#include "attention_mla.h"
#include "convert.h"


namespace tandem {
namespace {
#include "simd_scalar.h"
#include "attention_mla_kernel.h"
}  // namespace

const MlaKernelTable kMlaTableScalar = {"scalar", &mla_item};
}  // namespace tandem
