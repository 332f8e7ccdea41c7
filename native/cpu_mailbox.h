// The CPU's half of an offloaded MoE layer inside the one decode graph, with no host call between
// layers: the graph posts a layer's CPU pairs to a mailbox in pinned host memory and a later kernel of
// the layer waits for the answer there (engine/kernels/cpu_mailbox_gpu.py); this thread answers.
//
// Why not the driver: a graph's host nodes run on the driver's own thread and hold the stream while
// they run; computing experts from them is slower than reading every miss over PCIe. Here the GPU
// writes and reads plain mapped memory, and the CPU sees a post as soon as the write crosses the link.
//
// The two regions, as int64 words (engine/experts/cpu_mailbox.py lays them out, 64-byte aligned):
//   to_cpu, written by the GPU: [0] post sequence number, [8] layer, [9] rows; then the layer's routing
//     ids (rows · top_k) int64, each pair's CPU mark (rows · top_k) int64, the routing weights
//     (rows · top_k) fp32 and x (rows, hidden) in x_dtype. The sequence number is written last.
//   to_gpu, written here: [0] answered sequence number, [8] status (0 ok, 1 the set failed); then the
//     sum over the layer's CPU pairs, out (rows, hidden) fp32. The sequence number is written last.
// The GPU posts the next layer only after it has read this answer, so one mailbox is enough.
//
// A store of GGUF blocks (QuantTable) is answered by quant_moe's kernels over the blocks, x first
// converted to fp32; a store of tensors by moe_ffn's.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common.h"
#include "convert.h"
#include "quant_moe.h"
#include "routed_set.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace tandem {

struct MailboxShape {
  int64_t* to_cpu;          // see above
  int64_t* to_gpu;
  int64_t ids_word, cpu_word, weights_word, x_word, out_word;  // each array's first word in its region
  int64_t max_rows, top_k, hidden, inter;
  DType x_dtype, w_dtype;
  int64_t n_layers, n_experts;
  int threads;
};

// A quantised store: every (layer, expert)'s gate, up and down block addresses, and each layer's three
// block types (ggml codes; a layer without routed experts: zeros, never posted).
struct QuantTable {
  std::vector<int64_t> blocks;  // (n_layers · n_experts · 3)
  std::vector<int32_t> types;   // (n_layers · 3)
};

class CpuMailbox {
 public:
  // The worker spins this long after a post for the next one, then polls at kIdlePoll (a post after
  // an idle spell waits up to that long: decode steps post every few hundred microseconds).
  static constexpr std::chrono::milliseconds kSpinWindow{5};
  static constexpr std::chrono::microseconds kIdlePoll{50};

  // rows: (n_layers · n_experts) table rows of every expert in the store (addresses, strides), kept
  // here; or, for a store of blocks, quant (rows then empty).
  CpuMailbox(const MailboxShape& s, std::vector<MoeExpert> rows, QuantTable quant = {})
      : s_(s), rows_(std::move(rows)), quant_(std::move(quant)) {
    auto require = [](bool ok, const char* what) {
      if (!ok) throw std::invalid_argument(what);
    };
    require(s.to_cpu && s.to_gpu, "null mailbox");
    require(s.max_rows > 0 && s.top_k > 0 && s.n_layers > 0 && s.n_experts > 0, "empty mailbox shape");
    if (quant_.blocks.empty()) {
      require(int64_t(rows_.size()) == s.n_layers * s.n_experts, "the expert table must have a row per (layer, expert)");
    } else {
      require(int64_t(quant_.blocks.size()) == s.n_layers * s.n_experts * 3,
              "the block table must have gate, up and down addresses per (layer, expert)");
      require(int64_t(quant_.types.size()) == s.n_layers * 3, "the block types must be three per layer");
      for (int64_t l = 0; l < s.n_layers; ++l) {
        const int32_t* t = quant_.types.data() + l * 3;
        if (t[0] == 0) continue;  // no routed experts in this layer
        require(s.hidden % qblock_weights(t[0]) == 0 && s.hidden % qblock_weights(t[1]) == 0 &&
                    s.inter % qblock_weights(t[2]) == 0, "a layer's expert rows are not whole blocks of its types");
      }
    }
    require(s.hidden % 16 == 0 && s.inter % 16 == 0, "hidden and inter must be multiples of 16");
    seen_ = load(s_.to_cpu);  // answer posts after this one
    thread_ = std::thread([this] { loop(); });
  }
  CpuMailbox(const CpuMailbox&) = delete;
  CpuMailbox& operator=(const CpuMailbox&) = delete;

  // The caller makes sure no graph waits on this mailbox any more (it synchronises the device first).
  ~CpuMailbox() {
    stop_.store(true);
    thread_.join();
  }

  int64_t answered() const { return answered_.load(); }
  int64_t experts() const { return experts_.load(); }
  double compute_s() const { return compute_ns_.load() * 1e-9; }
  // Sums over the posts that computed experts, for a least-squares line of a post's time against its
  // expert count (the split's per-post and per-expert costs): (posts, Σc, Σc², Σt, Σc·t), t in seconds.
  std::vector<double> fit_sums() {
    std::lock_guard<std::mutex> lock(mu_);
    return {fit_[0], fit_[1], fit_[2], fit_[3], fit_[4]};
  }
  std::string error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  using Clock = std::chrono::steady_clock;

  static int64_t load(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  static void store(int64_t* p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  }

  void loop() {
    Clock::time_point last = Clock::now();
    while (!stop_.load(std::memory_order_relaxed)) {
      const int64_t posted = load(s_.to_cpu);
      if (posted == seen_) {
        if (Clock::now() - last < kSpinWindow) pause();
        else std::this_thread::sleep_for(kIdlePoll);
        continue;
      }
      seen_ = posted;
      answer(posted);
      last = Clock::now();
    }
  }

  void answer(int64_t seq) {
    const Clock::time_point start = Clock::now();
    int64_t status = 0;
    try {
      const int64_t layer = s_.to_cpu[8], n_rows = s_.to_cpu[9];
      if (layer < 0 || layer >= s_.n_layers) throw std::invalid_argument("the mailbox names a layer out of range");
      if (n_rows < 1 || n_rows > s_.max_rows) throw std::invalid_argument("the mailbox holds a row count out of range");
      const int64_t n_pairs = n_rows * s_.top_k;
      const int64_t* ids = s_.to_cpu + s_.ids_word;
      const int64_t* marks = s_.to_cpu + s_.cpu_word;
      chosen_.clear();
      for (int64_t p = 0; p < n_pairs; ++p)  // the marked pairs' experts, each once (routed_set sorts them)
        if (marks[p] && std::find(chosen_.begin(), chosen_.end(), ids[p]) == chosen_.end()) chosen_.push_back(ids[p]);
      float* out = reinterpret_cast<float*>(s_.to_gpu + s_.out_word);
      if (chosen_.empty()) {
        std::memset(out, 0, size_t(n_rows * s_.hidden) * sizeof(float));
      } else if (!quant_.blocks.empty()) {
        answer_blocks(layer, n_rows, ids, marks, out);
        experts_ += int64_t(chosen_.size());
      } else {
        const MoeProblem p = build_routed_set(
            s_.to_cpu + s_.x_word, s_.x_dtype, n_rows, s_.hidden, s_.inter, s_.hidden, s_.w_dtype,
            rows_.data() + layer * s_.n_experts, s_.n_experts, chosen_.data(), int64_t(chosen_.size()), ids, s_.top_k,
            s_.to_cpu + s_.weights_word, DType::f32, out, s_.hidden, routed_);
        moe_ffn(p, s_.threads);
        experts_ += int64_t(chosen_.size());
      }
    } catch (const std::exception& e) {
      status = 1;
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.empty()) error_ = e.what();
    }
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    compute_ns_ += ns;
    if (status == 0 && !chosen_.empty()) {
      const double c = double(chosen_.size()), t = double(ns) * 1e-9;
      std::lock_guard<std::mutex> lock(mu_);
      fit_[0] += 1, fit_[1] += c, fit_[2] += c * c, fit_[3] += t, fit_[4] += c * t;
    }
    ++answered_;
    s_.to_gpu[8] = status;
    store(s_.to_gpu, seq);  // last: the GPU reads out and the status once it sees this
  }

  // The chosen experts over a quantised store: x to fp32, each expert's marked pairs grouped (its
  // token rows and weights), then quant_moe's one parallel region adds the set into out.
  void answer_blocks(int64_t layer, int64_t n_rows, const int64_t* ids, const int64_t* marks, float* out) {
    const int64_t H = s_.hidden, n_pairs = n_rows * s_.top_k;
    x32_.resize(size_t(n_rows * H));
    const void* x = s_.to_cpu + s_.x_word;
    for (int64_t i = 0; i < n_rows * H; ++i) x32_[size_t(i)] = load_as_f32(x, s_.x_dtype, i);
    const float* w = reinterpret_cast<const float*>(s_.to_cpu + s_.weights_word);
    set_.clear(), tokens_.clear(), weights_.clear();
    for (int64_t e : chosen_) {
      if (e < 0 || e >= s_.n_experts) throw std::invalid_argument("the mailbox names an expert out of range");
      int64_t n = 0;
      for (int64_t p = 0; p < n_pairs; ++p)
        if (marks[p] && ids[p] == e) tokens_.push_back(p / s_.top_k), weights_.push_back(w[p]), ++n;
      const int64_t* b = quant_.blocks.data() + (layer * s_.n_experts + e) * 3;
      set_.push_back({reinterpret_cast<const uint8_t*>(b[0]), reinterpret_cast<const uint8_t*>(b[1]),
                      reinterpret_cast<const uint8_t*>(b[2]), n});
    }
    const int32_t* t = quant_.types.data() + layer * 3;
    QuantMoeProblem p{x32_.data(), n_rows, H, s_.inter, H, QType(t[0]), QType(t[1]), QType(t[2]), set_.data(),
                      int64_t(set_.size()), tokens_.data(), weights_.data(), out, H};
    std::memset(out, 0, size_t(n_rows * H) * sizeof(float));
    quant_moe(p, s_.threads);
  }

  MailboxShape s_;
  std::vector<MoeExpert> rows_;
  QuantTable quant_;
  std::vector<float> x32_, weights_;  // a quantised answer's fp32 rows and its pairs' weights
  std::vector<int64_t> tokens_;
  std::vector<QuantMoeExpert> set_;
  int64_t seen_ = 0;
  std::vector<int64_t> chosen_;
  RoutedSetBuffers routed_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> answered_{0}, experts_{0}, compute_ns_{0};
  std::mutex mu_;  // guards error_ and fit_
  std::string error_;
  double fit_[5] = {0, 0, 0, 0, 0};
  std::thread thread_;  // last: starts once every member above is constructed
};

}  // namespace tandem
