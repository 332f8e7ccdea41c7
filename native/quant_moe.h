// One MoE layer's CPU set over quantised experts, in one native call: for each expert its tokens'
// rows are gathered, the gate and up products run over the expert's blocks, SiLU(gate)·up, the down
// product, and the weighted rows are added into out. Each product is quant_matmul (its threads split
// the rows, every thread streaming its own part of the blocks), so a set of J experts costs 3J forks
// of the team and no Python: the per-expert Python loop around the same products costs ~60 µs an
// expert, which at 8 experts × 48 layers a token is ~23 ms of a decode step.
//
// Decode sizes only (a few tokens an expert): the integer products' cost grows with the tokens, and
// above engine/quant/matmul.py's NATIVE_MAX_TOKENS dequantised tiles and a GEMM win (Python does those).
//
// gpt-oss's form: fp32 biases per expert added to the gate/up and down products, and the clamped
// SwiGLU (g = min(g, limit), u = clamp(u, ±limit), (u + 1)·g·σ(alpha·g)) in place of SiLU(g)·u.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "quant_blocks.h"

namespace tandem {

// An expert of the set: its gate (inter, hidden), up (inter, hidden) and down (hidden, inter) blocks
// (rows contiguous, as in a GGUF) and how many (token, choice) pairs it has.
struct QuantMoeExpert {
  const uint8_t* gate;
  const uint8_t* up;
  const uint8_t* down;
  int64_t n_pairs;
  const float* gate_up_bias = nullptr;  // (2·inter,) fp32, gate half first, or null: none
  const float* down_bias = nullptr;     // (hidden,) fp32, or null: none
};

struct QuantMoeProblem {
  const float* x;  // (n_rows, hidden) fp32, row stride x_stride
  int64_t n_rows, hidden, inter, x_stride;
  QType gate_type, up_type, down_type;  // one layer: every expert's matrices are of these types
  const QuantMoeExpert* experts;
  int64_t n_experts;
  const int64_t* tokens;  // (Σ n_pairs,) the token row of each pair, grouped by expert in table order
  const float* weights;   // (Σ n_pairs,) its routing weight
  float* out;             // (n_rows, hidden) fp32, row stride out_stride: the set's sum is added to it
  int64_t out_stride;
  bool clamped = false;  // gpt-oss's clamped SwiGLU instead of SiLU(g)·u
  float alpha = 1.702f, limit = 7.0f;
};

inline int64_t quant_row_bytes(QType type, int64_t k) {
  return k / qblock_weights(int(type)) * qblock_bytes(int(type));
}

// Throws std::invalid_argument on a problem the products cannot take (before any output is written).
inline void check_quant_moe(const QuantMoeProblem& p) {
  auto require = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(what);
  };
  require(p.x && p.out && p.experts && p.tokens && p.weights, "null pointer");
  require(p.n_rows > 0 && p.hidden > 0 && p.inter > 0, "a quantised CPU set has rows and widths");
  require(p.x_stride >= p.hidden && p.out_stride >= p.hidden, "row strides must cover a row");
  for (QType t : {p.gate_type, p.up_type, p.down_type}) require(qblock_bytes(int(t)) > 0, "unknown block type");
  require(p.hidden % qblock_weights(int(p.gate_type)) == 0 && p.hidden % qblock_weights(int(p.up_type)) == 0,
          "the gate and up rows are not whole blocks");
  require(p.inter % qblock_weights(int(p.down_type)) == 0, "the down rows are not whole blocks");
  int64_t pairs = 0;
  for (int64_t j = 0; j < p.n_experts; ++j) {
    const QuantMoeExpert& e = p.experts[j];
    require(e.gate && e.up && e.down && e.n_pairs >= 0, "an expert without blocks");
    pairs += e.n_pairs;
  }
  for (int64_t i = 0; i < pairs; ++i)
    require(p.tokens[i] >= 0 && p.tokens[i] < p.n_rows, "a token row is out of range");
}

inline void quant_moe(const QuantMoeProblem& p, int n_threads) {
  check_quant_moe(p);
  const int64_t H = p.hidden, I = p.inter;
  static thread_local std::vector<float> xs, gate, up, y;  // reused: no allocation once sizes settle
  int64_t at = 0;
  for (int64_t j = 0; j < p.n_experts; ++j) {
    const QuantMoeExpert& e = p.experts[j];
    const int64_t n = e.n_pairs;
    if (n == 0) continue;
    if (xs.size() < size_t(n * H)) xs.resize(size_t(n * H)), y.resize(size_t(n * H));
    if (gate.size() < size_t(n * I)) gate.resize(size_t(n * I)), up.resize(size_t(n * I));
    for (int64_t i = 0; i < n; ++i) {  // (n, H): the expert's tokens
      const float* row = p.x + p.tokens[at + i] * p.x_stride;
      std::copy(row, row + H, xs.data() + i * H);
    }
    quant_matmul({e.gate, p.gate_type, I, H, quant_row_bytes(p.gate_type, H), xs.data(), n, H, gate.data(), I},
                 n_threads);
    quant_matmul({e.up, p.up_type, I, H, quant_row_bytes(p.up_type, H), xs.data(), n, H, up.data(), I}, n_threads);
    for (int64_t i = 0; i < n * I; ++i) {  // act(gate, up), in place in gate: (n, I)
      float g = gate[size_t(i)], u = up[size_t(i)];
      if (e.gate_up_bias) g += e.gate_up_bias[i % I], u += e.gate_up_bias[I + i % I];
      if (p.clamped) {
        g = std::min(g, p.limit);
        u = std::max(std::min(u, p.limit), -p.limit);
        gate[size_t(i)] = (u + 1.0f) * g / (1.0f + std::exp(-p.alpha * g));
      } else {
        gate[size_t(i)] = g / (1.0f + std::exp(-g)) * u;
      }
    }
    quant_matmul({e.down, p.down_type, H, I, quant_row_bytes(p.down_type, I), gate.data(), n, I, y.data(), H},
                 n_threads);
    for (int64_t i = 0; i < n; ++i) {  // out[token] += weight · y
      const float w = p.weights[at + i];
      float* row = p.out + p.tokens[at + i] * p.out_stride;
      const float* yi = y.data() + i * H;
      if (e.down_bias)
        for (int64_t h = 0; h < H; ++h) row[h] += w * (yi[h] + e.down_bias[h]);
      else
        for (int64_t h = 0; h < H; ++h) row[h] += w * yi[h];
    }
    at += n;
  }
}

}  // namespace tandem
