// layer_ops.h's operations: plain loops for the baseline ISA, which the compiler vectorises (they
// read a few KB per token; the products around them read MBs).
#include "layer_ops.h"

#include <cmath>

#include "common.h"

namespace tandem {
namespace {

// Rows below which a call stays on the calling thread: waking the team costs about what 64 rows of
// a 576-wide norm do.
constexpr int64_t kMinParallelRows = 64;

int team(int n_threads, int64_t rows) {
  if (rows < kMinParallelRows) return 1;
  return n_threads > 0 ? n_threads : default_threads();
}

void norm_row(const float* x, const float* w, float* out, int64_t dim, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < dim; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / float(dim) + eps);
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) out[i] = w[i] * (x[i] * inv);
}

}  // namespace

void rms_norm(const float* x, int64_t x_stride, const float* w, float* out, int64_t out_stride, int64_t rows,
              int64_t dim, float eps, int n_threads) {
  const int nt = team(n_threads, rows);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * x_stride, w, out + r * out_stride, dim, eps);
}

void add_rms_norm(const float* x, const float* r, const float* w, float* h, float* out, int64_t rows, int64_t dim,
                  float eps, int n_threads) {
  const int nt = team(n_threads, rows);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t at = row * dim;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) h[at + i] = x[at + i] + r[at + i];
    norm_row(h + at, w, out + at, dim, eps);
  }
}

void rope_rotate_half(float* x, int64_t tokens, int64_t token_stride, int64_t heads, int64_t head_dim,
                      int64_t rotary, const float* cos, const float* sin, int n_threads) {
  const int64_t half = rotary / 2;
  const int nt = team(n_threads, tokens);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + t * rotary;
    const float* s = sin + t * rotary;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + t * token_stride + h * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

}  // namespace tandem
