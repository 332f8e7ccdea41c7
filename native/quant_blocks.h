// GGUF's quantised block formats that the CPU reads in place, and the quantised matrix product's
// problem description. The layouts are those of the GGUF files (ggml's type numbering). The 32-weight
// types have one fp16 scale d (and for Q4_1/Q5_1 an fp16 offset m) in front:
//
//   Q4_0  18 bytes: d, 16 bytes of nibbles      w[j] = (lo(qs[j]) − 8)·d, w[j+16] = (hi(qs[j]) − 8)·d
//   Q4_1  20 bytes: d, m, 16 bytes of nibbles   w[j] = lo(qs[j])·d + m,   w[j+16] = hi(qs[j])·d + m
//   Q5_0  22 bytes: d, qh (u32), 16 nibbles     w[i] = (q[i] − 16)·d, q[i] = Q4_0's nibble | bit i of qh << 4
//   Q5_1  24 bytes: d, m, qh, 16 nibbles        w[i] = q[i]·d + m
//   Q8_0  34 bytes: d, 32 int8                  w[j] = qs[j]·d
//   MXFP4 17 bytes: e (E8M0), 16 nibbles        w[j] = E2M1(lo(qs[j]))·2^(e−127), w[j+16] from hi(qs[j])
//
// MXFP4 (OCP microscaling, gpt-oss's experts): each nibble is an E2M1 float, sign in bit 3 and
// magnitude one of {0, 0.5, 1, 1.5, 2, 3, 4, 6}; e is a bare power-of-two exponent byte. The kernels
// read the codes as their doubled values, small integers in {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}, with the
// scale halved to 2^(e−128), so an MXFP4 block is "q·s" like Q8_0's and every value is exact in fp32
// (q·2^(e−128), fp32's subnormals included; e = 255 with |q| ≥ 4 is +-inf, as gguf's dequantisation).
//
// The K-quants (256-weight super-blocks, kquant_blocks.h) are read as 8 sub-blocks of 32 weights, each
// with its own scale and offset, so every type is "32 small integers q, w = q·s + c" to the kernels.
//
// Activations are quantised per 32-block to int16 (scale a_d = max|x|/32767) so that a block's dot
// product is one exact integer dot: Σ w·x ≈ s·a_d·Σ q·a_q + c·a_d·Σ a_q (the offset's term: c = −8·d
// for Q4_0, m for Q4_1, …). quant_kernels.h says why int16 and not int8, and where the AVX2 kernels
// take int8 all the same (the K-quants: kquant_kernels.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"
#include "kquant_blocks.h"

namespace tandem {

// ggml's numbers, as the GGUF header stores them
enum class QType : int { q4_0 = 2, q4_1 = 3, q5_0 = 6, q5_1 = 7, q8_0 = 8, q4_k = 12, q5_k = 13, q6_k = 14, mxfp4 = 39 };
constexpr int64_t kQBlock = 32;   // weights per (sub-)block: the unit of the activations' quantisation
constexpr int64_t kQKBlock = 256;  // weights per K-quant super-block

// Bytes per block (per super-block for the K-quants), 0 for a type this file does not know.
constexpr int64_t qblock_bytes(int type) {
  switch (type) {
    case int(QType::q4_0): return 18;
    case int(QType::q4_1): return 20;
    case int(QType::q5_0): return 22;
    case int(QType::q5_1): return 24;
    case int(QType::q8_0): return 34;
    case int(QType::q4_k): return 144;
    case int(QType::q5_k): return 176;
    case int(QType::q6_k): return 210;
    case int(QType::mxfp4): return 17;
    default: return 0;
  }
}

// Weights per block: 32, or 256 for the K-quants (a row's width must be a multiple of it).
constexpr int64_t qblock_weights(int type) {
  return type == int(QType::q4_k) || type == int(QType::q5_k) || type == int(QType::q6_k) ? kQKBlock : kQBlock;
}

// A Q4_0 / Q4_1 matrix's rows re-laid 16 at a time for one-token products (interleaved16.h builds it;
// quant_kernels.h's interleaved_rows reads it). Per group of 16 rows and per 32-weight block: pair j
// of the block (weights 2j, 2j+1) of each of the 16 rows as one byte (low nibble, high nibble), 16
// bytes a pair, 256 a block; then the 16 rows' scales and offsets as floats (w = q·scale + offset).
struct Interleaved16 {
  const uint8_t* pairs;  // (groups, k/32, 16 pairs, 16 rows)
  const float* scale;    // (groups, k/32, 16 rows)
  const float* offset;   // (groups, k/32, 16 rows)
  int64_t groups;        // rows [0, 16·groups); the rest stay with the row kernel
};

// y (n_tokens, n_rows) fp32 = x (n_tokens, k) fp32 · Wᵀ, W (n_rows, k) as rows of k/qblock_weights blocks.
struct QuantMatmulProblem {
  const uint8_t* w;     // row r at w + r·w_row_bytes
  QType type;
  int64_t n_rows, k, w_row_bytes;
  const float* x;       // (n_tokens, k), row stride x_stride (floats), unit stride along k
  int64_t n_tokens, x_stride;
  float* y;             // (n_tokens, n_rows), row stride y_stride (floats)
  int64_t y_stride;
  const Interleaved16* interleaved = nullptr;  // the same rows re-laid, read by one-token products; or null
};

constexpr bool is_kquant(QType t) { return t == QType::q4_k || t == QType::q5_k || t == QType::q6_k; }

// The activations of one call quantised per block: q (n_tokens, k) int16 contiguous; d and s
// (n_tokens, k/32): each block's scale and d·Σq (the offset term's factor).
// The int8 form, which a table with quantize_acts8 (AVX2, AVX-512) reads for the K-quants instead: q8
// (n_tokens, k) int8, d8 (n_tokens, k/256) one scale a super-block (max|x|/127), b8 (n_tokens, k/16)
// Σq8 over each 16 values (the mins' and Q6_K's centring terms). Null where no product reads it.
struct QuantActs {
  const int16_t* q;
  const float* d;
  const float* s;
  const int8_t* q8 = nullptr;
  const float* d8 = nullptr;
  const int16_t* b8 = nullptr;
};

struct QuantKernelTable;

// One call's quantised activations (n_tokens rows of k), each form filled only where one of the
// call's products reads it: reserve() with the products' types, then quantize() each token row
// (any thread), then at(first row) for a product's view.
class QuantActsBuffer {
 public:
  // k_quants / others: whether any product of the call is of a K-quant type / of another type.
  void reserve(const QuantKernelTable& K, int64_t n_tokens, int64_t k, bool k_quants, bool others);
  void quantize(const QuantKernelTable& K, int64_t row, const float* x);
  QuantActs at(int64_t row) const;

 private:
  int64_t k_ = 0;
  bool i16_ = false, i8_ = false;
  std::vector<int16_t> q_, b8_;
  std::vector<float> d_, s_, d8_;
  std::vector<int8_t> q8_;
};

// The kernels of one instruction set; threading lives in quant_dispatch.cpp.
struct QuantKernelTable {
  const char* name;
  void (*quantize_acts)(const float* x, int64_t k, int16_t* q, float* d, float* s);  // one token
  // One token in the int8 form (QuantActs' q8, d8, b8); null where the K-quants read the int16 form.
  void (*quantize_acts8)(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsum);
  // Rows [row_begin, row_end) of y, every token.
  void (*matmul_rows)(const QuantMatmulProblem&, const QuantActs&, int64_t row_begin, int64_t row_end);
  void (*dequantize_row)(const uint8_t* w, QType type, int64_t k, float* out);  // k floats
  void (*dequantize_row_bf16)(const uint8_t* w, QType type, int64_t k, uint16_t* out);  // k bf16, nearest even
  // One token's rows [16·group_begin, 16·group_end) of y from P.interleaved; null where this ISA has none.
  void (*interleaved_rows)(const QuantMatmulProblem& P, const QuantActs& A, int64_t group_begin, int64_t group_end);
};

extern const QuantKernelTable kQuantTableScalar;
#if defined(TANDEM_X86_KERNELS)
extern const QuantKernelTable kQuantTableAvx2;
extern const QuantKernelTable kQuantTableAvx512;
extern const QuantKernelTable kQuantTableAvx512Vnni;
#endif

// A parallel region's rows handed out in chunks from one shared counter: a thread that is free takes
// the next chunk. With a fixed share each, a thread that started late or was interrupted kept the
// others waiting at the region's barrier: on 2 AVX2 cores the decode step's main thread spun there for
// ~37% of a token (py-spy). A row's sums do not depend on which thread or chunk computes it.
class RowChunks {
 public:
  // About 8 chunks a thread, each whole multiples of 16 rows (a product's L1/L2 row chunk).
  RowChunks(int64_t total, int threads) : total_(total) {
    chunk_ = std::max<int64_t>(16, (total / (int64_t(std::max(threads, 1)) * 8) + 15) / 16 * 16);
  }
  // The next chunk [begin, end) of the rows, false once none is left.
  bool next(int64_t& begin, int64_t& end) {
    begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
    end = std::min(total_, begin + chunk_);
    return begin < total_;
  }

 private:
  std::atomic<int64_t> next_{0};
  int64_t total_, chunk_;
};

// quant_dispatch.cpp
const QuantKernelTable& active_quant_table();
// Rows [lo, hi) of one product by K: whole groups of 16 from P.interleaved where it has a copy and the
// call is one token, the rest (and every other product) by the row kernel.
void quant_rows(const QuantKernelTable& K, const QuantMatmulProblem& P, const QuantActs& A, int64_t lo, int64_t hi);
bool select_quant_isa(const char* name);  // "auto" or one of supported_quant_isas()
int supported_quant_isas(const char** names, int capacity);
// Several products of one x (a layer's q, k and v, or gate and up): parts[i] shares x, n_tokens,
// x_stride and k with parts[0]. The activations are quantised once, and the parts' rows, taken as one
// matrix, are shared out in chunks (RowChunks), so one call costs one team wake-up.
void quant_matmul(const QuantMatmulProblem* parts, int n_parts, int n_threads);
// Rows of W as fp32 (bf16 with out_bf16): rows [row_begin, row_end), or, when ids is not null, rows
// ids[0 … n_ids) in turn (an embedding lookup); out row i at out + i·out_stride elements.
void quant_dequantize(const uint8_t* w, QType type, int64_t k, int64_t w_row_bytes, int64_t row_begin,
                      int64_t row_end, const int64_t* ids, int64_t n_ids, void* out, bool out_bf16,
                      int64_t out_stride, int n_threads);

}  // namespace tandem
