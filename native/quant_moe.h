// One MoE layer's CPU set over quantised experts, in one native call: for each expert its tokens'
// rows are quantised, the gate and up products run over the expert's blocks, SiLU(gate)·up, the down
// product, and the weighted rows are added into out. The whole set is one parallel region: the
// threads split the layer's gate/up rows, then its down rows, across all experts at once. No Python:
// the per-expert Python loop around the same products costs ~60 µs an expert, which at 8 experts ×
// 48 layers a token is ~23 ms of a decode step.
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

#if defined(_OPENMP)
#include <omp.h>
#endif

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
  // the three matrices' 16-row interleaved copies (interleaved16.h), read where the expert has one pair
  const Interleaved16* gate_rows = nullptr;
  const Interleaved16* up_rows = nullptr;
  const Interleaved16* down_rows = nullptr;
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

// Calls f(segment, r0, r1) over the chunks this thread takes of n_segments × seg_rows rows laid end to
// end: the whole layer's rows shared out at once, so no expert waits for another's barrier.
template <class F>
inline void for_row_chunks(RowChunks& chunks, int64_t seg_rows, F&& f) {
  for (int64_t g0, g1; chunks.next(g0, g1);)
    for (int64_t g = g0; g < g1;) {
      const int64_t seg = g / seg_rows, r0 = g % seg_rows, r1 = std::min(seg_rows, r0 + (g1 - g));
      f(seg, r0, r1);
      g += r1 - r0;
    }
}

// A set's scratch, kept by the calling thread (the native worker) between calls.
struct QuantMoeBuffers {
  std::vector<int64_t> active, first;  // experts with pairs; each one's first pair, then the total
  QuantActsBuffer ax, ah;              // (pairs, H), (pairs, I) quantised rows
  std::vector<float> gate, up, y;      // (pairs, I), (pairs, I), (pairs, H)
};

inline void quant_moe(const QuantMoeProblem& p, int n_threads) {
  check_quant_moe(p);
  const QuantKernelTable& K = active_quant_table();
  const int64_t H = p.hidden, I = p.inter;
  // Reused across calls on this thread (the native worker): no allocation once sizes settle.
  // Thread-locals of the calling thread, named through these references: inside the parallel region
  // the bare names would be each team thread's own (empty) copies.
  static thread_local QuantMoeBuffers buffers;
  auto &active = buffers.active, &first = buffers.first;
  auto &ax = buffers.ax, &ah = buffers.ah;
  auto &gate = buffers.gate, &up = buffers.up, &y = buffers.y;
  active.clear(), first.clear();
  int64_t pairs = 0;
  for (int64_t j = 0; j < p.n_experts; ++j) {
    if (p.experts[j].n_pairs > 0) active.push_back(j), first.push_back(pairs);
    pairs += p.experts[j].n_pairs;
  }
  if (pairs == 0) return;
  first.push_back(pairs);
  auto fit = [](auto& v, int64_t n) { if (v.size() < size_t(n)) v.resize(size_t(n)); };
  fit(y, pairs * H), fit(gate, pairs * I), fit(up, pairs * I);
  ax.reserve(K, pairs, H, is_kquant(p.gate_type) || is_kquant(p.up_type),
             !is_kquant(p.gate_type) || !is_kquant(p.up_type));
  ah.reserve(K, pairs, I, is_kquant(p.down_type), !is_kquant(p.down_type));
  const int64_t J = int64_t(active.size());
  const int nt = n_threads > 0 ? n_threads : default_threads();
  RowChunks gate_up_rows(2 * J * I, nt), down_rows(J * H, nt);

  // One fork of the team for the whole set and four barriers. With a fork per product (3J of them), 8
  // experts of one token took 2.35 ms on the GPU machine's 16 threads and no less on 4, against 0.89 ms
  // for the BF16 set's one fork a layer (benchmarks/h200/2026-12-05-quantised).
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
#if defined(_OPENMP)
    const int parts = omp_get_num_threads(), part = omp_get_thread_num();
#else
    const int parts = 1, part = 0;
#endif
    // 1. each pair's token row, quantised per block (the gate and up products read it)
#pragma omp for schedule(static)
    for (int64_t i = 0; i < pairs; ++i)
      ax.quantize(K, i, p.x + p.tokens[i] * p.x_stride);

    // 2. gate and up: segment 2a is expert a's gate (I rows), 2a+1 its up
    for_row_chunks(gate_up_rows, I, [&](int64_t seg, int64_t r0, int64_t r1) {
      const QuantMoeExpert& e = p.experts[active[size_t(seg / 2)]];
      const int64_t f = first[size_t(seg / 2)], n = e.n_pairs;
      const bool is_up = seg % 2;
      const QType type = is_up ? p.up_type : p.gate_type;
      float* out = (is_up ? up : gate).data() + f * I;
      const QuantMatmulProblem P{is_up ? e.up : e.gate, type, I, H, quant_row_bytes(type, H), nullptr, n, H, out, I,
                                 is_up ? e.up_rows : e.gate_rows};
      quant_rows(K, P, ax.at(f), r0, r1);
    });
#pragma omp barrier

    // 3. act(gate, up) per pair row, quantised for the down product
#pragma omp for schedule(static)
    for (int64_t i = 0; i < pairs; ++i) {
      const int64_t a = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
      const QuantMoeExpert& e = p.experts[active[size_t(a)]];
      float* g = gate.data() + i * I;
      const float* u = up.data() + i * I;
      for (int64_t c = 0; c < I; ++c) {
        float gc = g[c], uc = u[c];
        if (e.gate_up_bias) gc += e.gate_up_bias[c], uc += e.gate_up_bias[I + c];
        if (p.clamped) {
          gc = std::min(gc, p.limit);
          uc = std::max(std::min(uc, p.limit), -p.limit);
          g[c] = (uc + 1.0f) * gc / (1.0f + std::exp(-p.alpha * gc));
        } else {
          g[c] = gc / (1.0f + std::exp(-gc)) * uc;
        }
      }
      ah.quantize(K, i, g);
    }

    // 4. down: segment a is expert a's down (H rows)
    for_row_chunks(down_rows, H, [&](int64_t a, int64_t r0, int64_t r1) {
      const QuantMoeExpert& e = p.experts[active[size_t(a)]];
      const int64_t f = first[size_t(a)];
      const QuantMatmulProblem P{e.down, p.down_type, H, I, quant_row_bytes(p.down_type, I), nullptr, e.n_pairs, I,
                                 y.data() + f * H, H, e.down_rows};
      quant_rows(K, P, ah.at(f), r0, r1);
    });
#pragma omp barrier

    // 5. out[token] += weight · (y + bias): each thread its own columns, so pairs of one token never race
    const int64_t h0 = H * part / parts, h1 = H * (part + 1) / parts;
    for (int64_t a = 0; a < J; ++a) {
      const QuantMoeExpert& e = p.experts[active[size_t(a)]];
      for (int64_t i = first[size_t(a)]; i < first[size_t(a) + 1]; ++i) {
        const float w = p.weights[i];
        float* row = p.out + p.tokens[i] * p.out_stride;
        const float* yi = y.data() + i * H;
        if (e.down_bias)
          for (int64_t h = h0; h < h1; ++h) row[h] += w * (yi[h] + e.down_bias[h]);
        else
          for (int64_t h = h0; h < h1; ++h) row[h] += w * yi[h];
      }
    }
  }
}

}  // namespace tandem
