// One decode layer's CPU set built from the layer's routing, in C++ on the driving thread, straight
// into buffers the worker owns. Done in Python (numpy grouping of the pairs, the table rows, the
// checks and the hand-off) it costs the driving thread ~0.12 ms per layer step before the CPU set can
// start; here it is a few microseconds for the 8–64 (token, choice) pairs of a decode step.
//
// The set is laid out exactly as experts_cpu.prepare_moe_table takes it from Python: the chosen
// experts in ascending order, each expert's pairs in (token, choice) order, so moe_ffn adds the same
// numbers in the same order and the result is bit-identical.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "convert.h"

namespace tandem {

struct RoutedSetBuffers {
  std::vector<MoeExpert> table;  // (J,) the chosen experts' rows with their pair counts
  std::vector<int64_t> tokens;   // (pairs,) token row of each pair, grouped by expert
  std::vector<float> weights;    // (pairs,) routing weight of each pair, fp32
  std::vector<int64_t> index_of; // (E,) position of an expert among the chosen, or -1
  std::vector<int64_t> order;    // (J,) the chosen experts, ascending
  std::vector<int64_t> next;     // (J,) where each expert's next pair goes
};

// rows: (n_experts, 5) the layer's table rows for every expert (addresses, strides; pairs ignored);
// chosen: the experts the CPU computes (any order, distinct); ids (n_rows, top_k) the layer's routing;
// route_w (n_rows, top_k) its weights in route_dtype. Fills buf and returns the problem (its pointers
// point into buf). Throws std::invalid_argument on anything out of range.
inline MoeProblem build_routed_set(const void* x, DType x_dtype, int64_t n_rows, int64_t hidden, int64_t inter,
                                   int64_t x_stride, DType w_dtype, const MoeExpert* rows, int64_t n_experts,
                                   const int64_t* chosen, int64_t n_chosen, const int64_t* ids, int64_t top_k,
                                   const void* route_w, DType route_dtype, float* out, int64_t out_stride,
                                   RoutedSetBuffers& buf) {
  auto require = [](bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(what);
  };
  require(n_rows > 0 && top_k > 0 && n_experts > 0 && n_chosen > 0, "a routed CPU set has rows, choices and experts");
  require(hidden % 16 == 0 && inter % 16 == 0, "hidden and inter must be multiples of 16");
  require(x_stride >= hidden && out_stride >= hidden, "row strides must cover a row");
  require(x && out && rows && chosen && ids && route_w, "null pointer");
  buf.index_of.assign(size_t(n_experts), -1);
  std::vector<int64_t>& order = buf.order;  // every buffer is reused: no allocation once sizes settle
  order.assign(chosen, chosen + n_chosen);
  std::sort(order.begin(), order.end());
  buf.table.resize(size_t(n_chosen));
  for (int64_t j = 0; j < n_chosen; ++j) {
    const int64_t e = order[size_t(j)];
    require(e >= 0 && e < n_experts, "a chosen expert is out of range");
    require(buf.index_of[size_t(e)] < 0, "the chosen experts must be distinct");
    buf.index_of[size_t(e)] = j;
    MoeExpert row = rows[e];
    require(row.gate_up_ptr && row.down_ptr && row.gate_up_stride >= hidden && row.down_stride >= inter,
            "a chosen expert has no weights in the store, or strides that do not cover a row");
    row.n_pairs = 0;
    buf.table[size_t(j)] = row;
  }
  const int64_t n_pairs_all = n_rows * top_k;
  for (int64_t p = 0; p < n_pairs_all; ++p) {
    require(ids[p] >= 0 && ids[p] < n_experts, "a routed expert id is out of range");
    const int64_t j = buf.index_of[size_t(ids[p])];
    if (j >= 0) ++buf.table[size_t(j)].n_pairs;
  }
  std::vector<int64_t>& next = buf.next;
  next.assign(size_t(n_chosen), 0);
  int64_t total = 0;
  for (int64_t j = 0; j < n_chosen; ++j) {
    next[size_t(j)] = total;
    total += buf.table[size_t(j)].n_pairs;
  }
  buf.tokens.resize(size_t(total));
  buf.weights.resize(size_t(total));
  for (int64_t p = 0; p < n_pairs_all; ++p) {  // in (token, choice) order: stable within an expert
    const int64_t j = buf.index_of[size_t(ids[p])];
    if (j < 0) continue;
    const int64_t at = next[size_t(j)]++;
    buf.tokens[size_t(at)] = p / top_k;
    float w;
    switch (route_dtype) {
      case DType::f32: w = static_cast<const float*>(route_w)[p]; break;
      case DType::bf16: w = bf16_to_f32(static_cast<const uint16_t*>(route_w)[p]); break;
      default: w = f16_to_f32(static_cast<const uint16_t*>(route_w)[p]); break;
    }
    buf.weights[size_t(at)] = w;
  }
  return MoeProblem{x, x_dtype, n_rows, hidden, inter, x_stride, w_dtype, buf.table.data(), n_chosen,
                    buf.tokens.data(), buf.weights.data(), out, out_stride};
}

}  // namespace tandem
