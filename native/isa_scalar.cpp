// The portable kernels: the same code as the vector paths with one-lane "vectors", compiled for the
// baseline ISA of the target. Always built; chosen when no vector ISA is available (or forced).
#include "common.h"
#include "convert.h"

namespace tandem {
namespace {
#include "simd_scalar.h"
#include "attention_kernel.h"
#include "experts_kernel.h"
}  // namespace

const KernelTable kTableScalar = {"scalar", &attention_item, &expert_activation_dtype, &expert_tiling,
                                  &expert_prepare_x, &expert_gate_up, &expert_down};
}  // namespace tandem
