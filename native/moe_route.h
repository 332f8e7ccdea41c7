// A MoE layer's router inside the CPU decode step (decode_layer.h): for B tokens of a few each,
//
//   logits = x · Wᵣᵀ                      (B, E) fp32
//   p = softmax(logits); top k of p        (B, k) expert ids and weights, renormalised to sum 1 or not
//
// (engine/models/common.py softmax_topk: Qwen3-MoE, OLMoE, Mixtral), then the (token, choice) pairs
// grouped into quant_moe.h's set, in engine/quant/moe.py group_pairs' order: by distinct expert
// ascending, each one's pairs in (token, choice) order. A token's choices of one distinct expert (copies
// of one FFN: the built-in upcycled model) merge into one pair carrying their summed weight, so that
// FFN is computed once per token, as QuantResidentExperts.run computes it. In Python the router, the top-k and the
// grouping were ~12% of a 2-thread decode token of Qwen3-30B-A3B's widths on an AVX2 core, all of it
// serial while the other thread waited.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "quant_moe.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace tandem {

struct RoutedExperts {
  const float* router = nullptr;        // (E, H) fp32
  int64_t n_experts = 0, top_k = 0;
  bool renormalise = false;             // the top k weights divided by their sum
  std::vector<int64_t> group;           // (E,) each expert's distinct block set: copies of one FFN share one
  std::vector<QuantMoeExpert> blocks;   // (G,) their gate, up and down addresses (n_pairs unused)
  QType gate_type{}, up_type{}, down_type{};
  int64_t inter = 0;
  int64_t max_tokens = 0;               // more tokens than this leave the FFN half to the caller
};

class MoeRoute {
 public:
  // x (B, H) fp32 rows x_stride apart → the set adding Σ_k w_k · expert_k(x) to out (B, H); valid until
  // the next call.
  QuantMoeProblem route(const RoutedExperts& r, const float* x, int64_t x_stride, int64_t B, int64_t H, float* out,
                        int64_t out_stride, int n_threads) {
    const int64_t E = r.n_experts, k = r.top_k, G = int64_t(r.blocks.size());
    logits_.resize(size_t(B * E));
    const int nt = n_threads > 0 ? n_threads : 1;
    // the router's 4·E·H bytes read once for all B tokens; each thread its experts
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t e = 0; e < E; ++e) {
      const float* w = r.router + e * H;
      for (int64_t b = 0; b < B; ++b) {
        const float* xb = x + b * x_stride;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t h = 0; h < H; ++h) s += w[h] * xb[h];
        logits_[size_t(b * E + e)] = s;
      }
    }
    ids_.resize(size_t(B * k)), weights_.resize(size_t(B * k)), order_.resize(size_t(E));
    for (int64_t b = 0; b < B; ++b) {
      float* p = logits_.data() + b * E;  // → softmax probabilities in place
      const float top = *std::max_element(p, p + E);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - top));
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
      std::iota(order_.begin(), order_.end(), int64_t(0));
      std::partial_sort(order_.begin(), order_.begin() + k, order_.end(),
                        [p](int64_t a, int64_t c) { return p[a] > p[c] || (p[a] == p[c] && a < c); });
      float chosen = 0.0f;
      for (int64_t j = 0; j < k; ++j) chosen += p[order_[size_t(j)]];
      for (int64_t j = 0; j < k; ++j) {
        const int64_t g = r.group[size_t(order_[size_t(j)])];
        const float w = r.renormalise ? p[order_[size_t(j)]] / chosen : p[order_[size_t(j)]];
        int64_t first = b * k;  // this token's earlier choice of the same group, if any
        while (first < b * k + j && ids_[size_t(first)] != g) ++first;
        if (first < b * k + j) {  // merged into it: this choice is no pair of its own
          weights_[size_t(first)] += w;
          ids_[size_t(b * k + j)] = -1;
        } else {
          ids_[size_t(b * k + j)] = g;
          weights_[size_t(b * k + j)] = w;
        }
      }
    }
    // a counting sort of the pairs (merged choices left out) by group, stable: (token, choice) order within each
    count_.assign(size_t(G + 1), 0);
    for (int64_t g : ids_)
      if (g >= 0) ++count_[size_t(g + 1)];
    experts_.clear();
    for (int64_t g = 0; g < G; ++g) {
      if (count_[size_t(g + 1)] == 0) continue;
      QuantMoeExpert e = r.blocks[size_t(g)];
      e.n_pairs = count_[size_t(g + 1)];
      experts_.push_back(e);
    }
    for (int64_t g = 0; g < G; ++g) count_[size_t(g + 1)] += count_[size_t(g)];  // → each group's first pair
    tokens_.resize(size_t(B * k)), pair_weights_.resize(size_t(B * k));
    for (int64_t i = 0; i < B * k; ++i) {
      if (ids_[size_t(i)] < 0) continue;
      const int64_t at = count_[size_t(ids_[size_t(i)])]++;
      tokens_[size_t(at)] = i / k, pair_weights_[size_t(at)] = weights_[size_t(i)];
    }
    return {x, B, H, r.inter, x_stride, r.gate_type, r.up_type, r.down_type, experts_.data(),
            int64_t(experts_.size()), tokens_.data(), pair_weights_.data(), out, out_stride};
  }

 private:
  std::vector<float> logits_, weights_, pair_weights_;
  std::vector<int64_t> ids_, order_, count_, tokens_;
  std::vector<QuantMoeExpert> experts_;
};

}  // namespace tandem
