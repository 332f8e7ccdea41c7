// GGUF's quantised block formats that the CPU reads in place, and the quantised matrix product's
// problem description. The layouts are those of the GGUF files (ggml's type numbering); every type
// here has 32 weights per block, one fp16 scale d (and for Q4_1 an fp16 offset m) in front:
//
//   Q4_0  18 bytes: d, 16 bytes of nibbles      w[j] = (lo(qs[j]) − 8)·d, w[j+16] = (hi(qs[j]) − 8)·d
//   Q4_1  20 bytes: d, m, 16 bytes of nibbles   w[j] = lo(qs[j])·d + m,   w[j+16] = hi(qs[j])·d + m
//   Q8_0  34 bytes: d, 32 int8                  w[j] = qs[j]·d
//
// Activations are quantised per 32-block to int16 (scale a_d = max|x|/32767) so that a block's dot
// product is one exact integer dot: Σ w·x ≈ d·a_d·Σ q·a_q (+ the offset's term a_d·Σ a_q times −8·d
// for Q4_0, m for Q4_1). quant_kernels.h says why int16 and not int8.
#pragma once

#include <cstdint>

#include "common.h"

namespace tandem {

enum class QType : int { q4_0 = 2, q4_1 = 3, q8_0 = 8 };  // ggml's numbers, as the GGUF header stores them
constexpr int64_t kQBlock = 32;                            // weights per block (all three types)

// Bytes per block, 0 for a type this file does not know.
inline int64_t qblock_bytes(int type) {
  switch (type) {
    case int(QType::q4_0): return 18;
    case int(QType::q4_1): return 20;
    case int(QType::q8_0): return 34;
    default: return 0;
  }
}

// y (n_tokens, n_rows) fp32 = x (n_tokens, k) fp32 · Wᵀ, W (n_rows, k) as rows of k/32 blocks.
struct QuantMatmulProblem {
  const uint8_t* w;     // row r at w + r·w_row_bytes
  QType type;
  int64_t n_rows, k, w_row_bytes;
  const float* x;       // (n_tokens, k), row stride x_stride (floats), unit stride along k
  int64_t n_tokens, x_stride;
  float* y;             // (n_tokens, n_rows), row stride y_stride (floats)
  int64_t y_stride;
};

// The activations of one call quantised per block: q (n_tokens, k) int16 contiguous; d and s
// (n_tokens, k/32): each block's scale and d·Σq (the offset term's factor).
struct QuantActs {
  const int16_t* q;
  const float* d;
  const float* s;
};

// The kernels of one instruction set; threading lives in quant_dispatch.cpp.
struct QuantKernelTable {
  const char* name;
  void (*quantize_acts)(const float* x, int64_t k, int16_t* q, float* d, float* s);  // one token
  // Rows [row_begin, row_end) of y, every token.
  void (*matmul_rows)(const QuantMatmulProblem&, const QuantActs&, int64_t row_begin, int64_t row_end);
  void (*dequantize_row)(const uint8_t* w, QType type, int64_t k, float* out);  // k floats
};

extern const QuantKernelTable kQuantTableScalar;
#if defined(TANDEM_X86_KERNELS)
extern const QuantKernelTable kQuantTableAvx2;
extern const QuantKernelTable kQuantTableAvx512;
#endif

// quant_dispatch.cpp
const QuantKernelTable& active_quant_table();
bool select_quant_isa(const char* name);  // "auto" or one of supported_quant_isas()
int supported_quant_isas(const char** names, int capacity);
void quant_matmul(const QuantMatmulProblem& p, int n_threads);
// Rows of W as fp32: rows [row_begin, row_end), or, when ids is not null, rows ids[0 … n_ids) in turn
// (an embedding lookup); out row i at out + i·out_stride.
void quant_dequantize(const uint8_t* w, QType type, int64_t k, int64_t w_row_bytes, int64_t row_begin,
                      int64_t row_end, const int64_t* ids, int64_t n_ids, float* out, int64_t out_stride,
                      int n_threads);

}  // namespace tandem
