// The small operations of a decoder layer on the CPU, fp32: RMSNorm (with the residual add before
// it) and rotate-half RoPE in place.
//
// Each is a few µs of arithmetic for one token, but as torch ops a layer needs about twenty of them
// (a norm is six: pow, mean, add, rsqrt, two multiplies), each with µs of dispatch: on a CPU-only
// decode that dispatch outweighed the products of a small model. One call each here; rows
// are split over threads only when there are many of them (prefill).
#pragma once

#include <cstdint>

namespace tandem {

// out[r] = w ⊙ x[r] · (mean(x[r]²) + eps)^(−½), x and out (rows, dim) with row strides (out may be x).
void rms_norm(const float* x, int64_t x_stride, const float* w, float* out, int64_t out_stride, int64_t rows,
              int64_t dim, float eps, int n_threads);

// h = x + r, out = rms_norm(h): (rows, dim) each, contiguous (h may be x or r).
void add_rms_norm(const float* x, const float* r, const float* w, float* h, float* out, int64_t rows, int64_t dim,
                  float eps, int n_threads);

// RoPE in the rotate-half layout (the HF checkpoints') on the first `rotary` dims of each head, in
// place: x (tokens, heads, head_dim), token t at x + t·token_stride, heads contiguous; cos and sin
// (tokens, rotary) contiguous, the angles of each token's position.
//   x[i] ← x[i]·cos[i] − x[i + rotary/2]·sin[i],  x[i + rotary/2] ← x[i + rotary/2]·cos[i + rotary/2] + x[i]·sin[i + rotary/2]
void rope_rotate_half(float* x, int64_t tokens, int64_t token_stride, int64_t heads, int64_t head_dim,
                      int64_t rotary, const float* cos, const float* sin, int n_threads);

}  // namespace tandem
