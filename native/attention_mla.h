// Multi-head latent attention (DeepSeek-V2's MLA) in the absorbed form, decode: the problem, the
// per-ISA item kernels (attention_mla_kernel.h) and their dispatch (mla_dispatch.cpp).
//
// Every cached token is one row [latent c (r) | RoPE key (dr)] shared by all heads, kept as the
// hybrid KV format's K and V planes of w = (r + dr)/2 columns each (one KV head). Head h's score is
// q_h · [K plane | V plane] · scale and its output Σ p · row[:r]: r = w + (r − w) columns, the K plane
// then the first r − w of the V plane. Multi-query attention with V inside K, so an item reads each
// row once for all of its query rows (heads × queries): the latent is read once for 16+ heads.
#pragma once

#include <cstdint>

#include "common.h"

namespace tandem {

struct MlaProblem {
  const void* q;  // (B, n_heads, T, 2·width) with the strides below, unit stride on the last dim
  DType q_dtype;
  int64_t B, T, n_heads;
  int64_t width;      // w: columns of each plane (a row has 2·w)
  int64_t value_dim;  // r ≤ 2·w: the row's first r columns are the values
  int64_t q_stride_b, q_stride_h, q_stride_t;  // elements
  const KVBlock* blocks;  // n_kv = 1: (k_ptr, v_ptr) the two planes of a run of rows, strides in elements
  const int64_t* seq_offsets;  // sequence b owns blocks [seq_offsets[b], seq_offsets[b+1])
  DType kv_dtype;
  float scale;  // softmax scale on q·row (natural units)
  float* out;   // (B, n_heads, T, value_dim) fp32, contiguous
  float* lse;   // (B, n_heads, T) fp32, contiguous: natural log; −inf where a sequence has no rows
};

// An item: query rows [row_begin, row_end) of sequence b (row i = head i / T, query i % T, the order
// of `out`), over blocks [blk_begin, blk_end). Items read q as `qf`: fp32 (B, n_heads·T, 2·width),
// contiguous, converted once per call by the dispatch.
constexpr int kMlaMaxRows = 64;  // o (64 × 512 fp32, 128 KiB) and q (64 × 576) stay in L2
struct MlaItem {
  int64_t b, row_begin, row_end, blk_begin, blk_end;
};

// Partial result per item row, as the per-head kernel's: m = reference max in log2 units,
// l = Σ 2^(s − m), o = Σ 2^(s − m) · value (value_dim floats, unnormalised).
using MlaItemFn = void (*)(const MlaProblem&, const float* qf, const MlaItem&, float* o, float* m, float* l);

struct MlaKernelTable {
  const char* name;
  MlaItemFn item;
};

// One per ISA translation unit (isa_mla_*.cpp). The per-head kernels' ISA choice (select_isa,
// TANDEM_NATIVE_ISA) picks among these too, so a pinned ISA holds for every attention kernel;
// avx512bf16 and amx-bf16 run the AVX-512 one (attention_mla_kernel.h says why no bf16 dot products).
extern const MlaKernelTable kMlaTableScalar;
#if defined(TANDEM_X86_KERNELS)
extern const MlaKernelTable kMlaTableAvx2;
extern const MlaKernelTable kMlaTableAvx512;
#endif

// mla_dispatch.cpp
const MlaKernelTable& active_mla_table();
void attention_mla_decode(const MlaProblem& p, int n_threads);

}  // namespace tandem
