// One call for every routed expert the CPU computes in one MoE layer (moe_ffn, see MoeProblem in
// common.h), threaded by one OpenMP parallel region.
//
// Why one call: at decode an expert is a few tokens and ~9 MB of weights, and a call per expert
// pays a fork/join of the thread team (tens of µs from a Python worker thread, more while torch's
// own team spins next to it) plus the torch ops that gather rows and add results. Here the team
// forks once; the phases are separated by the barriers of its work-sharing loops:
//   A. gather each expert's token rows of x and convert them into the kernels' activation layout;
//   B. gate/up rows of all experts, one contiguous run of (expert, rows) per thread;
//   C. down rows of all experts the same way, each expert's result into its own fp32 scratch rows;
//   D. out[token] = Σ weight · y[pair] over the token's pairs, split over (token, column block):
//      every output element is written by one thread (no atomics), rows without pairs get zeros.
// Many tokens (prefill) go through in passes of ≤ kMaxPassRows padded rows, so the scratch stays
// a few MB; later passes add into out. Scratch lives in thread_local vectors of the calling thread.
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "common.h"
#include "convert.h"

namespace tandem {
namespace {

// Padded token rows per pass: activations (512 × H in bf16: 2 MB at H = 2048) and fp32 results (4 MB)
// stay small; an expert with more tokens is cut into several segments.
constexpr int64_t kMaxPassRows = 512;
// Vector tiles pad to 4 or 8 tokens, AMX tiles to at most 16 per group (amx_tiling): a segment of ≤ kMaxPassRows
// pairs padded to whole tiles still fits a pass.
static_assert(kMaxPassRows % 16 == 0, "a segment padded to whole tiles still fits a pass");
// Output columns per unit of the weighted sum (512 bytes of fp32).
constexpr int64_t kReduceCols = 128;

// One expert's pairs [pair_begin, pair_begin + P.n_tokens) within one pass.
struct Segment {
  ExpertProblem P;  // x: the gathered rows (unit stride, H per row); y: this segment's fp32 rows
  ExpertTiling T;
  int64_t pair_begin;
  int64_t act_begin;                // first padded row in the pass (phase A's index)
  int64_t cost1_begin, cost2_begin;  // where its rows start in the pass's stage-1 / stage-2 cost
  size_t xg_off, xs_off, h_off, y_off;  // bytes from the scratch base
};

struct Pass {
  int64_t seg_begin, seg_end, act_rows, cost1, cost2;
  int64_t csr_begin;  // its (N + 1) offsets into the pair entries, per token
};

// A pair as phase D reads it: the byte offset of its fp32 result row in the scratch, and its weight.
struct PairEntry {
  int64_t y_off;
  float weight;
};

constexpr size_t round64(size_t b) { return (b + 63) / 64 * 64; }
constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Stage 1 or 2 work of thread i of nt: its share [c0, c1) of the pass's cost, as whole units of
// each segment whose first cost lies in it (the shares tile every segment exactly).
template <bool kDown>
void run_stage(const KernelTable& K, const Segment* segs, const Pass& ps, char* base, int i, int nt) {
  const int64_t total = kDown ? ps.cost2 : ps.cost1;
  const int64_t c0 = total * i / nt, c1 = total * (i + 1) / nt;
  for (int64_t s = ps.seg_begin; s < ps.seg_end; ++s) {
    const Segment& S = segs[s];
    const int64_t begin = kDown ? S.cost2_begin : S.cost1_begin;
    const int64_t uc = S.T.rows_per_unit * S.T.row_cost;  // cost of one unit
    const int64_t n_units = (kDown ? S.P.hidden : S.P.inter) / S.T.rows_per_unit;
    if (begin >= c1) break;
    if (begin + n_units * uc <= c0) continue;
    const int64_t b = std::min(n_units, ceil_div(std::max<int64_t>(0, c0 - begin), uc));
    const int64_t e = std::min(n_units, ceil_div(std::max<int64_t>(0, c1 - begin), uc));
    if (e <= b) continue;
    const int64_t unit = S.T.rows_per_unit;
    if constexpr (kDown) K.expert_down(S.P, base + S.h_off, S.T, b * unit, e * unit);
    else K.expert_gate_up(S.P, base + S.xs_off, base + S.h_off, S.T, b * unit, e * unit);
  }
}

}  // namespace

void moe_ffn(const MoeProblem& M, int n_threads) {
  const KernelTable& K = active_table();
  const int nt = n_threads > 0 ? n_threads : default_threads();
  const int64_t N = M.n_rows, H = M.hidden, I = M.inter;
  if (N == 0) return;
  const size_t xes = dtype_size(M.x_dtype);
  const ExpertProblem proto{nullptr, M.x_dtype, 0, H, I, H, nullptr, nullptr, M.w_dtype, 0, 0, nullptr, DType::f32, H};
  const size_t aes = dtype_size(K.expert_activation_dtype(proto));  // the same for every expert

  // Plan: segments packed into passes, each segment's scratch at fixed offsets (reused by every pass).
  static thread_local std::vector<Segment> segs;
  static thread_local std::vector<Pass> passes;
  segs.clear(), passes.clear();
  size_t scratch_bytes = 0, cursor = 0;
  Pass cur{0, 0, 0, 0, 0, 0};
  auto close_pass = [&] {
    if (cur.seg_end > cur.seg_begin) passes.push_back(cur);
    cur = Pass{int64_t(segs.size()), int64_t(segs.size()), 0, 0, 0, 0};
    cursor = 0;
  };
  int64_t pair_end = 0;
  for (int64_t j = 0; j < M.n_experts; ++j) {
    const MoeExpert& E = M.experts[j];
    const int64_t pair_begin = pair_end;
    pair_end += E.n_pairs;
    for (int64_t p0 = pair_begin; p0 < pair_end; p0 += kMaxPassRows) {
      const int64_t n = std::min(kMaxPassRows, pair_end - p0);
      Segment S;
      S.P = ExpertProblem{nullptr, M.x_dtype, n, H, I, H, reinterpret_cast<const void*>(E.gate_up_ptr),
                          reinterpret_cast<const void*>(E.down_ptr), M.w_dtype, E.gate_up_stride,
                          E.down_stride, nullptr, DType::f32, H, M.form};
      S.P.form.gate_up_bias = M.biases ? reinterpret_cast<const void*>(M.biases[2 * j]) : nullptr;
      S.P.form.down_bias = M.biases ? reinterpret_cast<const void*>(M.biases[2 * j + 1]) : nullptr;
      S.T = K.expert_tiling(S.P);
      const int64_t n_pad = S.T.n_pad, row_cost = S.T.row_cost;
      if (cur.act_rows + n_pad > kMaxPassRows) close_pass();
      S.pair_begin = p0;
      S.act_begin = cur.act_rows, cur.act_rows += n_pad;
      S.cost1_begin = cur.cost1, cur.cost1 += I * row_cost;
      S.cost2_begin = cur.cost2, cur.cost2 += H * row_cost;
      S.xs_off = cursor, cursor += round64(size_t(n_pad * H) * aes);
      S.h_off = cursor, cursor += round64(size_t(n_pad * I) * aes);
      S.xg_off = cursor, cursor += round64(size_t(n * H) * xes);
      S.y_off = cursor, cursor += round64(size_t(n * H) * sizeof(float));
      scratch_bytes = std::max(scratch_bytes, cursor);
      segs.push_back(S);
      cur.seg_end = int64_t(segs.size());
    }
  }
  close_pass();

  if (passes.empty()) {  // no pairs: the sum is zero
    for (int64_t n = 0; n < N; ++n) std::memset(M.out + n * M.out_stride, 0, size_t(H) * sizeof(float));
    return;
  }

  // Per pass, per token: its pairs (CSR), for phase D.
  static thread_local std::vector<int64_t> csr;
  static thread_local std::vector<PairEntry> entries;
  csr.clear(), entries.clear();
  for (Pass& ps : passes) {
    ps.csr_begin = int64_t(csr.size());
    const int64_t first = int64_t(entries.size());
    csr.resize(csr.size() + size_t(N) + 1, 0);
    int64_t* start = csr.data() + ps.csr_begin;
    for (int64_t s = ps.seg_begin; s < ps.seg_end; ++s)
      for (int64_t t = 0; t < segs[s].P.n_tokens; ++t) ++start[M.tokens[segs[s].pair_begin + t] + 1];
    start[0] = first;
    for (int64_t n = 0; n < N; ++n) start[n + 1] += start[n];
    entries.resize(size_t(start[N]));
    static thread_local std::vector<int64_t> fill;
    fill.assign(start, start + N);
    for (int64_t s = ps.seg_begin; s < ps.seg_end; ++s) {
      const Segment& S = segs[s];
      for (int64_t t = 0; t < S.P.n_tokens; ++t) {
        const int64_t pair = S.pair_begin + t;
        entries[size_t(fill[M.tokens[pair]]++)] = {int64_t(S.y_off) + t * H * int64_t(sizeof(float)), M.weights[pair]};
      }
    }
  }

  static thread_local std::vector<char> buffer;
  if (buffer.size() < scratch_bytes + 64) buffer.resize(scratch_bytes + 64);
  char* base = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
  for (Segment& S : segs) S.P.x = base + S.xg_off, S.P.y = base + S.y_off;

  // The team's threads see other thread_local instances: hand them plain pointers.
  const Segment* seg_data = segs.data();
  const Pass* pass_data = passes.data();
  const int64_t n_passes = int64_t(passes.size());
  const int64_t* csr_data = csr.data();
  const PairEntry* entry_data = entries.data();
  const int64_t n_col_blocks = ceil_div(H, kReduceCols);
  const char* x = static_cast<const char*>(M.x);
  const size_t x_row_bytes = size_t(H) * xes;

#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    for (int64_t p = 0; p < n_passes; ++p) {  // every thread walks the passes; each phase ends in a barrier
      const Pass& ps = pass_data[p];
      // A: gather x[token] and convert it, one padded row at a time (padding rows are zeroed).
#pragma omp for schedule(static)
      for (int64_t r = 0; r < ps.act_rows; ++r) {
        const Segment* S = std::upper_bound(seg_data + ps.seg_begin, seg_data + ps.seg_end, r,
                                            [](int64_t v, const Segment& s) { return v < s.act_begin; }) - 1;
        const int64_t t = r - S->act_begin;
        if (t < S->P.n_tokens)
          std::memcpy(base + S->xg_off + t * x_row_bytes, x + M.tokens[S->pair_begin + t] * M.x_stride * int64_t(xes),
                      x_row_bytes);
        K.expert_prepare_x(S->P, base + S->xs_off, S->T, t, t + 1);
      }
      // B, C: one contiguous run of units per thread, across experts (the kernels read a run in blocks of
      // tiles, a K chunk at a time; see experts_kernel.h).
#pragma omp for schedule(static)
      for (int i = 0; i < nt; ++i) run_stage<false>(K, seg_data, ps, base, i, nt);
#pragma omp for schedule(static)
      for (int i = 0; i < nt; ++i) run_stage<true>(K, seg_data, ps, base, i, nt);
      // D: out[n, cols] (=, then += in later passes) Σ weight · y over token n's pairs.
#pragma omp for schedule(static)
      for (int64_t u = 0; u < N * n_col_blocks; ++u) {
        const int64_t n = u / n_col_blocks, c0 = u % n_col_blocks * kReduceCols, c1 = std::min(H, c0 + kReduceCols);
        float* o = M.out + n * M.out_stride;
        const int64_t e0 = csr_data[ps.csr_begin + n], e1 = csr_data[ps.csr_begin + n + 1];
        int64_t e = e0;
        if (p == 0) {
          if (e == e1) {
            for (int64_t c = c0; c < c1; ++c) o[c] = 0.0f;
            continue;
          }
          const float* y = reinterpret_cast<const float*>(base + entry_data[e].y_off);
          const float w = entry_data[e].weight;
          for (int64_t c = c0; c < c1; ++c) o[c] = w * y[c];
          ++e;
        }
        for (; e < e1; ++e) {
          const float* y = reinterpret_cast<const float*>(base + entry_data[e].y_off);
          const float w = entry_data[e].weight;
          for (int64_t c = c0; c < c1; ++c) o[c] += w * y[c];
        }
      }
    }
  }
}

}  // namespace tandem
