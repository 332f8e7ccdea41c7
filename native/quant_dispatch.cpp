// Run-time choice of the quantised-block kernels and the threading of each call (OpenMP).
//
// quant_matmul: the activations are quantised first (a token per iteration), then the output rows are
// cut into one contiguous range per thread: every thread streams its own part of the weight blocks,
// which is all the bandwidth a decode step has. Small matrices (a few rows) run on the calling
// thread: a fork of the team costs more than their work.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif
#include "common.h"
#include "quant_blocks.h"

namespace tandem {
namespace {

bool quant_cpu_supports(const QuantKernelTable* t) {
  if (t == &kQuantTableScalar) return true;
#if defined(TANDEM_X86_KERNELS)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (t == &kQuantTableAvx2) return avx2;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (t == &kQuantTableAvx512) return avx512;
  if (t == &kQuantTableAvx512Vnni) return avx512 && __builtin_cpu_supports("avx512vnni");
#endif
  return false;
}

// Best first.
const QuantKernelTable* const kAllQuantTables[] = {
#if defined(TANDEM_X86_KERNELS)
    &kQuantTableAvx512Vnni, &kQuantTableAvx512, &kQuantTableAvx2,
#endif
    &kQuantTableScalar,
};

const QuantKernelTable* find_quant_table(const char* name) {
  for (const QuantKernelTable* t : kAllQuantTables)
    if (std::strcmp(t->name, name) == 0) return t;
  return nullptr;
}

const QuantKernelTable* best_quant_table() {
  // TANDEM_NATIVE_ISA pins the other kernels' ISA; where it names one of these tables (avx512vnni,
  // avx512, avx2, scalar) it pins these too, so a forced-scalar run is scalar throughout.
  if (const char* forced = std::getenv("TANDEM_NATIVE_ISA")) {
    const QuantKernelTable* t = find_quant_table(forced);
    if (t && quant_cpu_supports(t)) return t;
  }
  for (const QuantKernelTable* t : kAllQuantTables)
    if (quant_cpu_supports(t)) return t;
  return &kQuantTableScalar;
}

std::atomic<const QuantKernelTable*> g_quant_table{nullptr};

// Rows below which the call stays on one thread: 64 rows of 576 Q4_1 weights are 23 KB, a few µs
// of streaming, about what waking the team costs.
constexpr int64_t kMinParallelRows = 64;

}  // namespace

const QuantKernelTable& active_quant_table() {
  const QuantKernelTable* t = g_quant_table.load(std::memory_order_acquire);
  if (!t) {
    t = best_quant_table();
    g_quant_table.store(t, std::memory_order_release);
  }
  return *t;
}

bool select_quant_isa(const char* name) {
  const QuantKernelTable* t = std::strcmp(name, "auto") == 0 ? best_quant_table() : find_quant_table(name);
  if (!t || !quant_cpu_supports(t)) return false;
  g_quant_table.store(t, std::memory_order_release);
  return true;
}

// Rows [lo, hi) of one product: the whole groups of 16 rows from its interleaved copy where it has
// one and the call is one token (the rows of a chunk cut at another product's edge come before and
// after them), the rest by the row kernel.
void quant_rows(const QuantKernelTable& K, const QuantMatmulProblem& P, const QuantActs& A, int64_t lo, int64_t hi) {
  if (P.interleaved && P.n_tokens == 1 && K.interleaved_rows) {
    const int64_t g0 = (lo + 15) / 16, g1 = std::min(hi / 16, P.interleaved->groups);
    if (g0 < g1) {
      if (lo < 16 * g0) K.matmul_rows(P, A, lo, 16 * g0);
      K.interleaved_rows(P, A, g0, g1);
      if (16 * g1 < hi) K.matmul_rows(P, A, 16 * g1, hi);
      return;
    }
  }
  K.matmul_rows(P, A, lo, hi);
}

int supported_quant_isas(const char** names, int capacity) {
  int n = 0;
  for (const QuantKernelTable* t : kAllQuantTables)
    if (quant_cpu_supports(t) && n < capacity) names[n++] = t->name;
  return n;
}

void QuantActsBuffer::reserve(const QuantKernelTable& K, int64_t n_tokens, int64_t k, bool k_quants, bool others) {
  k_ = k;
  i8_ = k_quants && K.quantize_acts8;
  i16_ = others || (k_quants && !K.quantize_acts8);
  auto fit = [](auto& v, int64_t n) {
    if (v.size() < size_t(n)) v.resize(size_t(n));
  };
  if (i16_) fit(q_, n_tokens * k), fit(d_, n_tokens * (k / kQBlock)), fit(s_, n_tokens * (k / kQBlock));
  if (i8_) fit(q8_, n_tokens * k), fit(d8_, n_tokens * (k / kQKBlock)), fit(b8_, n_tokens * (k / 16));
}

void QuantActsBuffer::quantize(const QuantKernelTable& K, int64_t row, const float* x) {
  const int64_t nb = k_ / kQBlock;
  if (i16_) K.quantize_acts(x, k_, q_.data() + row * k_, d_.data() + row * nb, s_.data() + row * nb);
  if (i8_) K.quantize_acts8(x, k_, q8_.data() + row * k_, d8_.data() + row * (k_ / kQKBlock), b8_.data() + row * (k_ / 16));
}

QuantActs QuantActsBuffer::at(int64_t row) const {
  QuantActs A{nullptr, nullptr, nullptr};
  const int64_t nb = k_ / kQBlock;
  if (i16_) A.q = q_.data() + row * k_, A.d = d_.data() + row * nb, A.s = s_.data() + row * nb;
  if (i8_) A.q8 = q8_.data() + row * k_, A.d8 = d8_.data() + row * (k_ / kQKBlock), A.b8 = b8_.data() + row * (k_ / 16);
  return A;
}

void quant_matmul(const QuantMatmulProblem* parts, int n_parts, int n_threads) {
  if (n_parts <= 0) return;
  const QuantKernelTable& K = active_quant_table();
  const int nt = n_threads > 0 ? n_threads : default_threads();
  const QuantMatmulProblem& P = parts[0];  // x, n_tokens, k: the same in every part
  int64_t total_rows = 0;
  bool k_quants = false, others = false;
  for (int i = 0; i < n_parts; ++i) total_rows += parts[i].n_rows, (is_kquant(parts[i].type) ? k_quants : others) = true;
  // the calling thread's, named through a reference: inside the region the bare name would be each
  // team thread's own copy
  static thread_local QuantActsBuffer buffer;
  QuantActsBuffer& acts = buffer;
  acts.reserve(K, P.n_tokens, P.k, k_quants, others);
  const QuantActs A = acts.at(0);
  const bool parallel = nt > 1 && total_rows >= kMinParallelRows;
  RowChunks rows(total_rows, parallel ? nt : 1);

#pragma omp parallel num_threads(nt) if (parallel)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < P.n_tokens; ++t) acts.quantize(K, t, P.x + t * P.x_stride);
    // after the implicit barrier of the loop above: every token is quantised. Chunks of the parts'
    // rows stacked, each cut at the parts' edges.
    for (int64_t r0, r1; rows.next(r0, r1);) {
      int64_t first = 0;  // the stacked index of this part's row 0
      for (int i = 0; i < n_parts; ++i) {
        const int64_t lo = std::max(r0, first) - first, hi = std::min(r1, first + parts[i].n_rows) - first;
        if (hi > lo) quant_rows(K, parts[i], A, lo, hi);
        first += parts[i].n_rows;
      }
    }
  }
}

void quant_dequantize(const uint8_t* w, QType type, int64_t k, int64_t w_row_bytes, int64_t row_begin,
                      int64_t row_end, const int64_t* ids, int64_t n_ids, void* out, bool out_bf16,
                      int64_t out_stride, int n_threads) {
  const QuantKernelTable& K = active_quant_table();
  const int nt = n_threads > 0 ? n_threads : default_threads();
  const int64_t n = ids ? n_ids : row_end - row_begin;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && n >= kMinParallelRows)
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* row = w + (ids ? ids[i] : row_begin + i) * w_row_bytes;
    if (out_bf16)
      K.dequantize_row_bf16(row, type, k, static_cast<uint16_t*>(out) + i * out_stride);
    else
      K.dequantize_row(row, type, k, static_cast<float*>(out) + i * out_stride);
  }
}

}  // namespace tandem
