// A decode graph's CPU experts, run by host nodes of the graph itself (engine/experts/graph_cpu.py).
//
// In the pieces form every MoE layer hands its tokens to Python: a sync, a plan and a hand-off cost
// the driving thread 0.3–0.8 ms per layer on the H200 host, 15–40 ms a step for 48 layers. Here the
// GPU plans the split on the device, copies the layer's hidden state and CPU pairs to pinned memory,
// and a host node of the same graph (cuLaunchHostFunc, captured) calls `entry` on the CUDA driver's
// callback thread. No Python and no GIL are involved; the GPU's own experts of the layer run on a
// parallel branch of the graph meanwhile.
//
// The buffers are shared by every layer: a layer's branch ends (join) before the next layer forks.
// The caller owns them and the expert table and keeps them alive while any graph that calls `entry`
// exists. Nothing here may call CUDA (a host node must not), and nothing may throw out of `entry`:
// an error is kept for the caller, who reads it after the replay, and the layer's rows become zeros.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace tandem {

class HostMoe {
 public:
  struct Call {  // a host node's user data: which layer, how many rows
    HostMoe* owner;
    int64_t layer, n_rows;
  };
  struct Stats {
    int64_t calls = 0, experts = 0, pairs = 0;
    double compute_s = 0;
  };

  // x (max_rows, hidden) in x_dtype; pairs (max_rows · top_k) int64: the expert of each (token,
  // choice) pair that runs here, −1 for the rest; weights (max_rows · top_k) fp32; out (max_rows,
  // hidden) fp32, every row of a call written; table (n_layers, n_experts) rows: every expert's
  // addresses and row strides in the store (its pair count is ignored).
  HostMoe(const void* x, DType x_dtype, const int64_t* pairs, const float* weights, float* out, int64_t max_rows,
          int64_t top_k, int64_t hidden, int64_t inter, DType w_dtype, const MoeExpert* table, int64_t n_layers,
          int64_t n_experts, int threads)
      : x_(x), x_dtype_(x_dtype), pairs_(pairs), weights_(weights), out_(out), max_rows_(max_rows), top_k_(top_k),
        hidden_(hidden), inter_(inter), w_dtype_(w_dtype), table_(table), n_layers_(n_layers),
        n_experts_(n_experts), threads_(threads) {}

  // The user data of a host node for (layer, n_rows): its address stays valid for this object's life.
  Call* call(int64_t layer, int64_t n_rows) {
    if (layer < 0 || layer >= n_layers_) throw std::invalid_argument("layer out of range");
    if (n_rows < 1 || n_rows > max_rows_) throw std::invalid_argument("n_rows must be in [1, max_rows]");
    std::lock_guard<std::mutex> lock(mu_);
    for (Call& c : calls_)
      if (c.layer == layer && c.n_rows == n_rows) return &c;
    calls_.push_back(Call{this, layer, n_rows});
    return &calls_.back();
  }

  // What a host node runs (a plain function, as the driver calls it).
  static void entry(void* user) noexcept {
    auto* c = static_cast<Call*>(user);
    c->owner->run(c->layer, c->n_rows);
  }

  void run(int64_t layer, int64_t n_rows) noexcept {
    const auto start = std::chrono::steady_clock::now();
    int64_t n_experts = 0, n_pairs = 0;
    std::string error;
    try {
      std::tie(n_experts, n_pairs) = compute(layer, n_rows);
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "unknown error in the graph's CPU experts";
    }
    if (!error.empty()) std::memset(out_, 0, size_t(n_rows * hidden_) * sizeof(float));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::lock_guard<std::mutex> lock(mu_);
    stats_.calls += 1, stats_.experts += n_experts, stats_.pairs += n_pairs, stats_.compute_s += seconds;
    if (!error.empty() && error_.empty()) error_ = "layer " + std::to_string(layer) + ": " + error;
  }

  // Threads of the calls from now on (≤ 0: OpenMP's default).
  void set_threads(int n) { threads_.store(n); }

  // Counters since the last call, and the first error since then ("" if none).
  std::pair<Stats, std::string> take() {
    std::lock_guard<std::mutex> lock(mu_);
    std::pair<Stats, std::string> r{stats_, error_};
    stats_ = Stats{}, error_.clear();
    return r;
  }

 private:
  // The layer's CPU pairs grouped by expert (ascending; a token's pairs keep their order) as one
  // moe_ffn call → (experts, pairs).
  std::pair<int64_t, int64_t> compute(int64_t layer, int64_t n_rows) {
    const int64_t P = n_rows * top_k_;
    order_.clear();
    for (int64_t i = 0; i < P; ++i) {
      const int64_t e = pairs_[i];
      if (e < 0) continue;
      if (e >= n_experts_) throw std::out_of_range("expert id out of range");
      order_.push_back(i);
    }
    if (order_.empty()) {
      std::memset(out_, 0, size_t(n_rows * hidden_) * sizeof(float));
      return {0, 0};
    }
    std::stable_sort(order_.begin(), order_.end(), [this](int64_t a, int64_t b) { return pairs_[a] < pairs_[b]; });
    experts_.clear(), tokens_.clear(), weights_buf_.clear();
    const MoeExpert* row = table_ + layer * n_experts_;
    int64_t previous = -1;
    for (const int64_t i : order_) {
      const int64_t e = pairs_[i];
      if (e != previous) {
        previous = e;
        MoeExpert m = row[e];
        if (!m.gate_up_ptr || !m.down_ptr) throw std::invalid_argument("the expert has no weights in the store");
        m.n_pairs = 0;
        experts_.push_back(m);
      }
      experts_.back().n_pairs += 1;
      tokens_.push_back(i / top_k_);
      weights_buf_.push_back(weights_[i]);
    }
    const MoeProblem p{x_, x_dtype_, n_rows, hidden_, inter_, hidden_, w_dtype_, experts_.data(),
                       int64_t(experts_.size()), tokens_.data(), weights_buf_.data(), out_, hidden_};
    moe_ffn(p, threads_.load());
    return {int64_t(experts_.size()), int64_t(tokens_.size())};
  }

  const void* x_;
  DType x_dtype_;
  const int64_t* pairs_;
  const float* weights_;
  float* out_;
  int64_t max_rows_, top_k_, hidden_, inter_;
  DType w_dtype_;
  const MoeExpert* table_;
  int64_t n_layers_, n_experts_;
  std::atomic<int> threads_;
  std::vector<int64_t> order_, tokens_;  // scratch of `compute` (one host node runs at a time)
  std::vector<float> weights_buf_;
  std::vector<MoeExpert> experts_;
  std::mutex mu_;
  std::deque<Call> calls_;  // a deque: addresses stay put as it grows
  Stats stats_;
  std::string error_;
};

}  // namespace tandem
