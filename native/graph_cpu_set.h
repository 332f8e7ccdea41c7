// A decode layer's CPU set run by the GPU stream itself: a host node of the one-graph decode step
// (engine/experts/graph_cpu_set.py). The graph copies the layer's hidden state, routing weights and
// the pairs it gave the CPU into pinned buffers, then runs `tandem_graph_cpu_job` on the CUDA
// driver's callback thread, then copies the result back. No Python and no sync of the driving
// thread sits between the GPU's half of a layer and the CPU's: the pieces form paid 0.3–0.6 ms of
// host work per layer for that hand-off (benchmarks/RESULTS.md, 2026-11-30).
//
// A host function cannot throw into the driver: a failure is kept in the owner's error slot, the
// layer's CPU share comes back as zeros, and the owner's Python side raises it after the replay.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "routed_set.h"

namespace tandem {

struct GraphCpuSets;

// One (layer, batch size) of a captured graph: every pointer is fixed at capture.
struct GraphCpuJob {
  GraphCpuSets* owner;
  std::vector<MoeExpert> rows;  // (E,) the layer's experts in the host store
  const void* x;                // (n_rows, hidden) pinned, x_dtype: the layer's MoE input
  DType x_dtype, w_dtype, route_dtype;
  int64_t n_rows, hidden, inter, top_k;
  const int64_t* ids;      // (n_rows, top_k) pinned: the expert of each pair the CPU computes, -1 for the rest
  const void* route_w;     // (n_rows, top_k) pinned, route_dtype: the routing weights
  float* out;              // (n_rows, hidden) pinned fp32: Σ over the CPU's pairs, zero elsewhere
  int threads;
  RoutedSetBuffers buf;    // reused by every replay
  std::vector<int64_t> chosen;
  std::vector<uint8_t> seen;
};

struct GraphCpuSets {
  std::deque<GraphCpuJob> jobs;  // a deque: a job's address stays valid while others are added
  std::mutex mu;                 // guards the counters and the error against the reader thread
  std::string error;             // the first failure since the last `take_error`
  int64_t sets = 0, experts = 0, pairs = 0;  // CPU sets that ran (with ≥ 1 pair), experts and pairs in them
  double seconds = 0.0;          // computing them
};

inline void run_graph_cpu_job(GraphCpuJob& job) {
  const int64_t n_pairs = job.n_rows * job.top_k;
  const size_t out_bytes = size_t(job.n_rows * job.hidden) * sizeof(float);
  try {
    const int64_t E = int64_t(job.rows.size());
    job.seen.assign(size_t(E), 0);
    job.chosen.clear();
    for (int64_t p = 0; p < n_pairs; ++p) {
      const int64_t e = job.ids[p];
      if (e < 0) continue;
      if (e >= E) throw std::invalid_argument("a pair given to the CPU names an expert out of range");
      if (!job.seen[size_t(e)]) job.seen[size_t(e)] = 1, job.chosen.push_back(e);
    }
    if (job.chosen.empty()) {
      std::memset(job.out, 0, out_bytes);
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    const MoeProblem p = build_routed_set(job.x, job.x_dtype, job.n_rows, job.hidden, job.inter, job.hidden,
                                          job.w_dtype, job.rows.data(), E, job.chosen.data(),
                                          int64_t(job.chosen.size()), job.ids, job.top_k, job.route_w,
                                          job.route_dtype, job.out, job.hidden, job.buf, /*skip_negative=*/true);
    moe_ffn(p, job.threads);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int64_t pairs = 0;
    for (const MoeExpert& row : job.buf.table) pairs += row.n_pairs;
    std::lock_guard<std::mutex> lock(job.owner->mu);
    job.owner->sets += 1;
    job.owner->experts += int64_t(job.chosen.size());
    job.owner->pairs += pairs;
    job.owner->seconds += s;
  } catch (const std::exception& e) {
    std::memset(job.out, 0, out_bytes);
    std::lock_guard<std::mutex> lock(job.owner->mu);
    if (job.owner->error.empty()) job.owner->error = e.what();
  }
}

}  // namespace tandem

// The host function the graph's host node calls (CUhostFn): user_data is a GraphCpuJob*.
extern "C" inline void tandem_graph_cpu_job(void* user_data) {
  tandem::run_graph_cpu_job(*static_cast<tandem::GraphCpuJob*>(user_data));
}
