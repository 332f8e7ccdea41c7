// Python module engine._native: raw pointers, shapes and strides in; the GIL released for the
// whole of every compute call. Shapes are checked here once more (the Python wrappers in
// engine/kernels/ check dtypes, devices and layouts before they call).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_mla.h"
#include "bindings.h"
#include "common.h"
#include "cpu_mailbox.h"
#include "moe_worker.h"
#include "quant_blocks.h"
#include "quant_moe.h"

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(_OPENMP) && (defined(__linux__) || defined(__APPLE__))
#include <dlfcn.h>
#define TANDEM_HAS_DLADDR 1
#endif

using namespace tandem;

namespace {

DType dtype_of(int code) {
  if (code < 0 || code > 2) throw std::invalid_argument("dtype code must be 0 (fp32), 1 (bf16) or 2 (fp16)");
  return DType(code);
}

void attention_decode_py(uintptr_t q, int q_dtype, int64_t B, int64_t T, int64_t n_heads, int64_t head_dim,
                         int64_t q_stride_b, int64_t q_stride_h, int64_t q_stride_t, uintptr_t blocks,
                         uintptr_t seq_offsets, int64_t n_kv_heads, int kv_dtype, double scale, uintptr_t out,
                         uintptr_t lse, int threads) {
  require(B >= 0 && T >= 1 && n_heads >= 1 && n_kv_heads >= 1, "B ≥ 0, T ≥ 1 and head counts ≥ 1");
  require(n_heads % n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads");
  require(head_dim >= 16 && head_dim <= kMaxHeadDim && head_dim % 16 == 0,
          "head_dim must be a multiple of 16 in [16, 256]");
  require(B == 0 || (q && seq_offsets && out && lse), "null pointer");
  AttentionProblem p{reinterpret_cast<const void*>(q), dtype_of(q_dtype), B, T, n_heads, head_dim,
                     q_stride_b, q_stride_h, q_stride_t, reinterpret_cast<const KVBlock*>(blocks),
                     reinterpret_cast<const int64_t*>(seq_offsets), n_kv_heads, dtype_of(kv_dtype),
                     float(scale), reinterpret_cast<float*>(out), reinterpret_cast<float*>(lse)};
  if (B == 0) return;
  py::gil_scoped_release release;
  attention_decode(p, threads);
}

void attention_mla_decode_py(uintptr_t q, int q_dtype, int64_t B, int64_t T, int64_t n_heads, int64_t width,
                             int64_t value_dim, int64_t q_stride_b, int64_t q_stride_h, int64_t q_stride_t,
                             uintptr_t blocks, uintptr_t seq_offsets, int kv_dtype, double scale, uintptr_t out,
                             uintptr_t lse, int threads) {
  require(B >= 0 && T >= 1 && n_heads >= 1, "B ≥ 0, T ≥ 1 and n_heads ≥ 1");
  require(width >= 1 && value_dim >= 1 && value_dim <= 2 * width, "width ≥ 1 and 1 ≤ value_dim ≤ 2·width");
  require(B == 0 || (q && seq_offsets && out && lse), "null pointer");
  MlaProblem p{reinterpret_cast<const void*>(q), dtype_of(q_dtype), B, T, n_heads, width, value_dim,
               q_stride_b, q_stride_h, q_stride_t, reinterpret_cast<const KVBlock*>(blocks),
               reinterpret_cast<const int64_t*>(seq_offsets), dtype_of(kv_dtype), float(scale),
               reinterpret_cast<float*>(out), reinterpret_cast<float*>(lse)};
  if (B == 0) return;
  py::gil_scoped_release release;
  attention_mla_decode(p, threads);
}

// The experts' form from the bindings' arguments: act 0 (SwiGLU) or 1 (clamped SwiGLU, alpha, limit);
// biases in bias_dtype (their addresses are set by the caller).
ExpertForm expert_form(int act, double alpha, double limit, int bias_dtype) {
  require(act == 0 || act == 1, "act must be 0 (SwiGLU) or 1 (clamped SwiGLU)");
  require(std::isfinite(alpha) && std::isfinite(limit) && limit >= 0, "alpha must be finite and limit finite, ≥ 0");
  ExpertForm f;
  f.act = ExpertAct(act), f.alpha = float(alpha), f.limit = float(limit), f.bias_dtype = dtype_of(bias_dtype);
  return f;
}

void expert_ffn_py(uintptr_t x, int x_dtype, int64_t n_tokens, int64_t hidden, int64_t inter, int64_t x_stride,
                   uintptr_t gate_up, uintptr_t down, int w_dtype, int64_t gate_up_stride, int64_t down_stride,
                   uintptr_t y, int y_dtype, int64_t y_stride, int threads, int act, double alpha, double limit,
                   uintptr_t gate_up_bias, uintptr_t down_bias, int bias_dtype) {
  require(n_tokens >= 0 && hidden > 0 && inter > 0, "n_tokens ≥ 0, hidden and inter > 0");
  require(hidden % 16 == 0 && inter % 16 == 0, "hidden and inter must be multiples of 16");
  require(gate_up_stride >= hidden && down_stride >= inter && x_stride >= hidden && y_stride >= hidden,
          "row strides must cover a row");
  ExpertProblem p{reinterpret_cast<const void*>(x), dtype_of(x_dtype), n_tokens, hidden, inter, x_stride,
                  reinterpret_cast<const void*>(gate_up), reinterpret_cast<const void*>(down), dtype_of(w_dtype),
                  gate_up_stride, down_stride, reinterpret_cast<void*>(y), dtype_of(y_dtype), y_stride,
                  expert_form(act, alpha, limit, bias_dtype)};
  p.form.gate_up_bias = reinterpret_cast<const void*>(gate_up_bias);
  p.form.down_bias = reinterpret_cast<const void*>(down_bias);
  if (n_tokens == 0) return;
  require(x && gate_up && down && y, "null pointer");
  py::gil_scoped_release release;
  expert_ffn(p, threads);
}

// One MoE layer's CPU set as the kernels take it, checked here once so that no bad row number or
// count reaches their pointer arithmetic. n_rows == 0 is returned as is (nothing to compute).
MoeProblem checked_moe(uintptr_t x, int x_dtype, int64_t n_rows, int64_t hidden, int64_t inter, int64_t x_stride,
                       int w_dtype, const py::array_t<int64_t, py::array::c_style>& experts,
                       const py::array_t<int64_t, py::array::c_style>& tokens,
                       const py::array_t<float, py::array::c_style>& weights, uintptr_t out, int64_t out_stride,
                       const py::object& biases, int act, double alpha, double limit, int bias_dtype) {
  require(n_rows >= 0 && hidden > 0 && inter > 0, "n_rows ≥ 0, hidden and inter > 0");
  require(hidden % 16 == 0 && inter % 16 == 0, "hidden and inter must be multiples of 16");
  require(x_stride >= hidden && out_stride >= hidden, "row strides must cover a row");
  require(experts.ndim() == 2 && experts.shape(1) == 5, "experts must be an int64 table (J, 5)");
  require(tokens.ndim() == 1 && weights.ndim() == 1 && tokens.shape(0) == weights.shape(0),
          "tokens and weights must be 1-D and of one length");
  const int64_t n_experts = experts.shape(0), pairs = tokens.shape(0);
  const auto* table = reinterpret_cast<const MoeExpert*>(experts.data());
  const int64_t* token_ids = tokens.data();
  MoeProblem p{reinterpret_cast<const void*>(x), dtype_of(x_dtype), n_rows, hidden, inter, x_stride, dtype_of(w_dtype),
               table, n_experts, token_ids, weights.data(), reinterpret_cast<float*>(out), out_stride,
               expert_form(act, alpha, limit, bias_dtype)};
  if (!biases.is_none()) {  // the caller keeps the array alive as long as the table
    const auto b = biases.cast<py::array_t<int64_t, py::array::c_style>>();
    require(b.ndim() == 2 && b.shape(0) == n_experts && b.shape(1) == 2 && b.dtype().is(py::dtype::of<int64_t>()),
            "biases must be an int64 table (J, 2) of bias addresses");
    p.biases = b.data();
  }
  if (n_rows == 0) return p;
  require(x && out, "null pointer");
  int64_t total = 0;
  for (int64_t j = 0; j < n_experts; ++j) {
    const MoeExpert& e = table[j];
    require(e.n_pairs >= 0 && e.gate_up_stride >= hidden && e.down_stride >= inter,
            "pair counts must be ≥ 0 and row strides must cover a row");
    require(e.n_pairs == 0 || (e.gate_up_ptr && e.down_ptr), "null pointer");
    total += e.n_pairs;
  }
  require(total == pairs, "the experts' pair counts must add up to the length of tokens");
  for (int64_t i = 0; i < pairs; ++i) require(token_ids[i] >= 0 && token_ids[i] < n_rows, "token index out of range");
  return p;
}

void moe_ffn_py(uintptr_t x, int x_dtype, int64_t n_rows, int64_t hidden, int64_t inter, int64_t x_stride, int w_dtype,
                const py::array_t<int64_t, py::array::c_style>& experts,
                const py::array_t<int64_t, py::array::c_style>& tokens,
                const py::array_t<float, py::array::c_style>& weights, uintptr_t out, int64_t out_stride,
                int threads, const py::object& biases, int act, double alpha, double limit, int bias_dtype) {
  const MoeProblem p = checked_moe(x, x_dtype, n_rows, hidden, inter, x_stride, w_dtype, experts, tokens, weights,
                                   out, out_stride, biases, act, alpha, limit, bias_dtype);
  if (n_rows == 0) return;
  py::gil_scoped_release release;
  moe_ffn(p, threads);
}

void moe_submit_py(MoeWorker& worker, uintptr_t x, int x_dtype, int64_t n_rows, int64_t hidden, int64_t inter,
                   int64_t x_stride, int w_dtype, const py::array_t<int64_t, py::array::c_style>& experts,
                   const py::array_t<int64_t, py::array::c_style>& tokens,
                   const py::array_t<float, py::array::c_style>& weights, uintptr_t out, int64_t out_stride,
                   int threads, const py::object& biases, int act, double alpha, double limit, int bias_dtype) {
  require(n_rows > 0, "a CPU set handed to the worker has rows");
  worker.submit(checked_moe(x, x_dtype, n_rows, hidden, inter, x_stride, w_dtype, experts, tokens, weights, out,
                            out_stride, biases, act, alpha, limit, bias_dtype),
                threads);
}

// A layer's CPU set from its routing (routed_set.h): grouped here in C++ into the worker's own
// buffers, then started on the worker. rows (E, 5): the layer's table rows of every expert; chosen:
// the experts the CPU computes; ids (n_rows, top_k) the routing; route_weights: the address of its
// weights, (n_rows, top_k) contiguous, in route_dtype.
void moe_submit_routed_py(MoeWorker& worker, uintptr_t x, int x_dtype, int64_t n_rows, int64_t hidden, int64_t inter,
                          int64_t x_stride, int w_dtype, const py::array_t<int64_t, py::array::c_style>& rows,
                          const py::array_t<int64_t, py::array::c_style>& chosen,
                          const py::array_t<int64_t, py::array::c_style>& ids, uintptr_t route_weights,
                          int route_dtype, uintptr_t out, int64_t out_stride, int threads) {
  require(rows.ndim() == 2 && rows.shape(1) == 5, "rows must be an int64 table (E, 5)");
  require(chosen.ndim() == 1, "chosen must be 1-D");
  require(ids.ndim() == 2 && ids.shape(0) == n_rows, "ids must be (n_rows, top_k)");
  // before the buffers are touched: a pending set may still be reading them
  if (worker.pending()) throw std::logic_error("the previous CPU set has not been collected (wait)");
  const MoeProblem p = build_routed_set(
      reinterpret_cast<const void*>(x), dtype_of(x_dtype), n_rows, hidden, inter, x_stride, dtype_of(w_dtype),
      reinterpret_cast<const MoeExpert*>(rows.data()), rows.shape(0), chosen.data(), chosen.shape(0), ids.data(),
      ids.shape(1), reinterpret_cast<const void*>(route_weights), dtype_of(route_dtype),
      reinterpret_cast<float*>(out), out_stride, worker.routed_buffers());
  worker.submit(p, threads);
}

// The mailbox worker (cpu_mailbox.h) over two pinned regions the caller keeps alive longer than it.
// words: the first word of ids, CPU marks, weights and x in to_cpu, and of out in to_gpu. rows: every
// expert's table row, (n_layers, n_experts, 5) int64 (copied); or, for a store of blocks, blocks
// (n_layers, n_experts, 3) addresses and types (n_layers, 3) ggml codes, rows then (n_layers, n_experts, 0).
std::unique_ptr<CpuMailbox> make_mailbox(uintptr_t to_cpu, uintptr_t to_gpu, const std::vector<int64_t>& words,
                                         int64_t max_rows, int64_t top_k, int64_t hidden, int64_t inter,
                                         int x_dtype, int w_dtype,
                                         const py::array_t<int64_t, py::array::c_style>& rows, int threads,
                                         const py::array_t<int64_t, py::array::c_style>& blocks,
                                         const py::array_t<int32_t, py::array::c_style>& types) {
  require(words.size() == 5, "words: ids, cpu, weights, x (to_cpu) and out (to_gpu)");
  require(rows.ndim() == 3, "rows must be an int64 table (n_layers, n_experts, 5 or 0)");
  const bool quant = blocks.size() > 0;
  require(rows.shape(2) == (quant ? 0 : 5), "rows: 5 columns for tensors, none for a store of blocks");
  std::vector<MoeExpert> table;
  if (!quant) {
    const MoeExpert* first = reinterpret_cast<const MoeExpert*>(rows.data());
    table.assign(first, first + rows.shape(0) * rows.shape(1));
  }
  QuantTable q;
  if (quant) {
    require(blocks.ndim() == 3 && blocks.shape(0) == rows.shape(0) && blocks.shape(1) == rows.shape(1) &&
                blocks.shape(2) == 3, "blocks must be (n_layers, n_experts, 3) int64 addresses");
    require(types.ndim() == 2 && types.shape(0) == rows.shape(0) && types.shape(1) == 3, "types must be (n_layers, 3)");
    q.blocks.assign(blocks.data(), blocks.data() + blocks.size());
    q.types.assign(types.data(), types.data() + types.size());
    for (int32_t t : q.types)
      require(t == 0 || qblock_bytes(t) > 0, "a block type the quantised kernels do not know");
  }
  MailboxShape s{reinterpret_cast<int64_t*>(to_cpu), reinterpret_cast<int64_t*>(to_gpu), words[0], words[1],
                 words[2], words[3], words[4], max_rows, top_k, hidden, inter, dtype_of(x_dtype), dtype_of(w_dtype),
                 rows.shape(0), rows.shape(1), threads};
  return std::make_unique<CpuMailbox>(s, std::move(table), std::move(q));
}

// The file of the OpenMP runtime this module's calls bind to ("" if unknown or without OpenMP). The
// dynamic linker binds them to the first runtime in the global scope, which is torch's (it loads its
// libgomp RTLD_GLOBAL) even when the module was linked against another copy under another name.
std::string openmp_runtime() {
#if defined(TANDEM_HAS_DLADDR)
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&omp_get_max_threads), &info) && info.dli_fname) return info.dli_fname;
#endif
  return "";
}

// A quantised CPU set (quant_moe.h) from Python's arrays, copied: the problem's pointers point into
// the copies, which live as long as the set (the worker may run it after the call returns). x and out
// stay the caller's, alive until the set is done.
struct QuantMoeSet {
  std::vector<QuantMoeExpert> experts;
  std::vector<int64_t> tokens;
  std::vector<float> weights;
  QuantMoeProblem problem{};
  int threads = 0;
};

std::shared_ptr<QuantMoeSet> quant_moe_set(uintptr_t x, int64_t n_rows, int64_t hidden, int64_t inter,
                                           int64_t x_stride, int gate_type, int up_type, int down_type,
                                           const py::array_t<int64_t, py::array::c_style>& experts,
                                           const py::array_t<int64_t, py::array::c_style>& tokens,
                                           const py::array_t<float, py::array::c_style>& weights, uintptr_t out,
                                           int64_t out_stride, int threads, bool clamped, double alpha,
                                           double limit) {
  require(experts.ndim() == 2 && (experts.shape(1) == 4 || experts.shape(1) == 6),
          "experts must be an int64 table (J, 4): gate, up, down, pairs; or (J, 6) with the two bias addresses");
  require(tokens.ndim() == 1 && weights.ndim() == 1 && tokens.shape(0) == weights.shape(0),
          "tokens and weights: one per pair");
  auto set = std::make_shared<QuantMoeSet>();
  int64_t pairs = 0;
  for (int64_t j = 0; j < experts.shape(0); ++j) {
    const int64_t* r = experts.data() + experts.shape(1) * j;
    const bool biased = experts.shape(1) == 6;
    set->experts.push_back({reinterpret_cast<const uint8_t*>(r[0]), reinterpret_cast<const uint8_t*>(r[1]),
                            reinterpret_cast<const uint8_t*>(r[2]), r[3],
                            biased ? reinterpret_cast<const float*>(r[4]) : nullptr,
                            biased ? reinterpret_cast<const float*>(r[5]) : nullptr});
    pairs += r[3];
  }
  require(pairs == tokens.shape(0), "the experts' pair counts must add up to the pairs given");
  set->tokens.assign(tokens.data(), tokens.data() + tokens.shape(0));
  set->weights.assign(weights.data(), weights.data() + weights.shape(0));
  set->problem = {reinterpret_cast<const float*>(x), n_rows, hidden, inter, x_stride, QType(gate_type),
                  QType(up_type), QType(down_type), set->experts.data(), int64_t(set->experts.size()),
                  set->tokens.data(), set->weights.data(), reinterpret_cast<float*>(out), out_stride, clamped,
                  float(alpha), float(limit)};
  set->threads = threads;
  check_quant_moe(set->problem);  // here, so a bad set fails in the caller, not on the worker
  return set;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "Tandem's native CPU kernels: decode attention with LSE over KV block views, SwiGLU expert FFN, "
            "one MoE layer's experts in one call.";
  m.def("isa", [] { return std::string(active_table().name); }, "The instruction set the kernels use now.");
  m.def("supported_isas", [] {
    const char* names[8];
    const int n = supported_isas(names, 8);
    return std::vector<std::string>(names, names + n);
  }, "Instruction sets this CPU can run, best first.");
  m.def("select_isa", [](const std::string& name) { return select_isa(name.c_str()); }, py::arg("name"),
        "Use the kernels of one ISA ('auto': the best); False if this CPU cannot run it.");
  m.def("amx_min_tokens", &amx_min_tokens, "Fewest tokens per expert that the AMX tiles take (amx-bf16 only).");
  m.def("set_amx_min_tokens", &set_amx_min_tokens, py::arg("n"),
        "Send experts with ≥ n tokens to the AMX tiles (amx-bf16 only); fewer go to the vector tiles.");
  m.def("default_threads", &default_threads, "OpenMP's default thread count.");
  m.def("openmp_runtime", &openmp_runtime, "The OpenMP runtime file the kernels' thread teams come from.");
  m.def("attention_decode", &attention_decode_py, py::arg("q"), py::arg("q_dtype"), py::arg("B"), py::arg("T"),
        py::arg("n_heads"), py::arg("head_dim"), py::arg("q_stride_b"), py::arg("q_stride_h"),
        py::arg("q_stride_t"), py::arg("blocks"), py::arg("seq_offsets"), py::arg("n_kv_heads"),
        py::arg("kv_dtype"), py::arg("scale"), py::arg("out"), py::arg("lse"), py::arg("threads"),
        "Exact attention of q (B, n_heads, T, head_dim) over each sequence's KV blocks → out fp32 "
        "(B, n_heads, T, head_dim), lse fp32 (B, n_heads, T), both contiguous.");
  m.def("attention_mla_decode", &attention_mla_decode_py, py::arg("q"), py::arg("q_dtype"), py::arg("B"),
        py::arg("T"), py::arg("n_heads"), py::arg("width"), py::arg("value_dim"), py::arg("q_stride_b"),
        py::arg("q_stride_h"), py::arg("q_stride_t"), py::arg("blocks"), py::arg("seq_offsets"),
        py::arg("kv_dtype"), py::arg("scale"), py::arg("out"), py::arg("lse"), py::arg("threads"),
        "MLA decode, absorbed form: q (B, n_heads, T, 2·width) over each sequence's rows kept as two planes "
        "(the blocks' K and V views, one KV head) → out fp32 (B, n_heads, T, value_dim), lse fp32 (B, n_heads, T).");
  m.def("expert_ffn", &expert_ffn_py, py::arg("x"), py::arg("x_dtype"), py::arg("n_tokens"), py::arg("hidden"),
        py::arg("inter"), py::arg("x_stride"), py::arg("gate_up"), py::arg("down"), py::arg("w_dtype"),
        py::arg("gate_up_stride"), py::arg("down_stride"), py::arg("y"), py::arg("y_dtype"), py::arg("y_stride"),
        py::arg("threads"), py::arg("act") = 0, py::arg("alpha") = 1.702, py::arg("limit") = 7.0,
        py::arg("gate_up_bias") = 0, py::arg("down_bias") = 0, py::arg("bias_dtype") = 0,
        "y = down · act(gate·x + bg, up·x + bu) + bd with gate_up (2I, H), down (H, I); act 0: silu(g)·u, 1: "
        "gpt-oss's (clamp(u, ±limit) + 1)·g·σ(alpha·g), g = min(g, limit); biases: addresses of (2I,) gate half "
        "first and (H,) in bias_dtype, 0: none.");
  m.def("moe_ffn", &moe_ffn_py, py::arg("x"), py::arg("x_dtype"), py::arg("n_rows"), py::arg("hidden"),
        py::arg("inter"), py::arg("x_stride"), py::arg("w_dtype"), py::arg("experts").noconvert(),
        py::arg("tokens").noconvert(), py::arg("weights").noconvert(), py::arg("out"), py::arg("out_stride"),
        py::arg("threads"), py::arg("biases") = py::none(), py::arg("act") = 0, py::arg("alpha") = 1.702, py::arg("limit") = 7.0,
        py::arg("bias_dtype") = 0,
        "One MoE layer's experts: out (n_rows, H) fp32 = Σ_pairs weight · expert(x[token]). experts: int64 "
        "(J, 5) rows (gate_up ptr, down ptr, gate_up row stride, down row stride, pairs); expert j's pairs "
        "follow expert j − 1's in tokens (int64) and weights (fp32). The experts' form as expert_ffn's, with "
        "biases an int64 (J, 2) table of expert j's gate_up and down bias addresses (0: none) or None.");
  py::class_<MoeWorker>(m, "MoeWorker",
                        "A native thread that runs one MoE layer's CPU set at a time (moe_ffn) beside the "
                        "caller; no Python runs on it. The caller keeps the operands alive until `wait` returns.")
      .def(py::init<>())
      .def("submit", &moe_submit_py, py::arg("x"), py::arg("x_dtype"), py::arg("n_rows"), py::arg("hidden"),
           py::arg("inter"), py::arg("x_stride"), py::arg("w_dtype"), py::arg("experts").noconvert(),
           py::arg("tokens").noconvert(), py::arg("weights").noconvert(), py::arg("out"), py::arg("out_stride"),
           py::arg("threads"), py::arg("biases") = py::none(), py::arg("act") = 0, py::arg("alpha") = 1.702, py::arg("limit") = 7.0,
           py::arg("bias_dtype") = 0,
           "Start moe_ffn's arguments on the worker (the previous set must be collected).")
      .def("submit_routed", &moe_submit_routed_py, py::arg("x"), py::arg("x_dtype"), py::arg("n_rows"),
           py::arg("hidden"), py::arg("inter"), py::arg("x_stride"), py::arg("w_dtype"), py::arg("rows").noconvert(),
           py::arg("chosen").noconvert(), py::arg("ids").noconvert(), py::arg("route_weights"),
           py::arg("route_dtype"), py::arg("out"), py::arg("out_stride"), py::arg("threads"),
           "Build a layer's CPU set from its routing (the chosen experts' pairs, grouped as moe_ffn takes "
           "them) in the worker's buffers and start it.")
      .def("submit_quant", [](MoeWorker& w, uintptr_t x, int64_t n_rows, int64_t hidden, int64_t inter,
                              int64_t x_stride, int gate_type, int up_type, int down_type,
                              const py::array_t<int64_t, py::array::c_style>& experts,
                              const py::array_t<int64_t, py::array::c_style>& tokens,
                              const py::array_t<float, py::array::c_style>& weights, uintptr_t out,
                              int64_t out_stride, int threads, bool clamped, double alpha, double limit) {
        auto set = quant_moe_set(x, n_rows, hidden, inter, x_stride, gate_type, up_type, down_type, experts, tokens,
                                 weights, out, out_stride, threads, clamped, alpha, limit);
        w.submit_job([set] { quant_moe(set->problem, set->threads); });
      }, py::arg("x"), py::arg("n_rows"), py::arg("hidden"), py::arg("inter"), py::arg("x_stride"),
           py::arg("gate_type"), py::arg("up_type"), py::arg("down_type"), py::arg("experts").noconvert(),
           py::arg("tokens").noconvert(), py::arg("weights").noconvert(), py::arg("out"), py::arg("out_stride"),
           py::arg("threads"), py::arg("clamped") = false, py::arg("alpha") = 1.702, py::arg("limit") = 7.0,
           "Start quant_moe's arguments on the worker (the previous set must be collected).")
      .def("wait", [](MoeWorker& w) {
        py::gil_scoped_release release;
        return w.wait();
      }, "Block (without the GIL) until the set is done → (queue seconds, compute seconds).")
      .def_property_readonly("pending", &MoeWorker::pending, "A set was submitted and not yet collected.");
  py::class_<CpuMailbox>(m, "CpuMailbox",
                         "A native thread that answers MoE layers posted by a CUDA graph to a mailbox in pinned "
                         "memory (cpu_mailbox.h); no Python runs on it.")
      .def(py::init(&make_mailbox), py::arg("to_cpu"), py::arg("to_gpu"), py::arg("words"), py::arg("max_rows"),
           py::arg("top_k"), py::arg("hidden"), py::arg("inter"), py::arg("x_dtype"), py::arg("w_dtype"),
           py::arg("rows").noconvert(), py::arg("threads"),
           py::arg("blocks") = py::array_t<int64_t>(std::vector<py::ssize_t>{0, 0, 3}),
           py::arg("types") = py::array_t<int32_t>(std::vector<py::ssize_t>{0, 3}))
      .def_property_readonly("answered", &CpuMailbox::answered, "Posts answered so far.")
      .def_property_readonly("experts", &CpuMailbox::experts, "Experts computed so far.")
      .def_property_readonly("compute_s", &CpuMailbox::compute_s, "Seconds spent answering posts.")
      .def("fit_sums", &CpuMailbox::fit_sums,
           "(posts, sum c, sum c^2, sum t, sum c*t) over the posts that computed c > 0 experts, t in seconds.")
      .def("error", &CpuMailbox::error, "The first error a post met (empty if none).");
  m.def("quant_moe", [](uintptr_t x, int64_t n_rows, int64_t hidden, int64_t inter, int64_t x_stride, int gate_type,
                        int up_type, int down_type, const py::array_t<int64_t, py::array::c_style>& experts,
                        const py::array_t<int64_t, py::array::c_style>& tokens,
                        const py::array_t<float, py::array::c_style>& weights, uintptr_t out, int64_t out_stride,
                        int threads, bool clamped, double alpha, double limit) {
    auto set = quant_moe_set(x, n_rows, hidden, inter, x_stride, gate_type, up_type, down_type, experts, tokens,
                             weights, out, out_stride, threads, clamped, alpha, limit);
    py::gil_scoped_release release;
    quant_moe(set->problem, set->threads);
  }, py::arg("x"), py::arg("n_rows"), py::arg("hidden"), py::arg("inter"), py::arg("x_stride"), py::arg("gate_type"),
        py::arg("up_type"), py::arg("down_type"), py::arg("experts").noconvert(), py::arg("tokens").noconvert(),
        py::arg("weights").noconvert(), py::arg("out"), py::arg("out_stride"), py::arg("threads"),
        py::arg("clamped") = false, py::arg("alpha") = 1.702, py::arg("limit") = 7.0,
        "A MoE layer's CPU set over quantised experts, added into out (N, H) fp32: experts (J, 4) int64 "
        "(gate, up, down block addresses, pairs; (J, 6) adds fp32 gate_up and down bias addresses), the pairs' "
        "token rows and weights grouped by expert; clamped: gpt-oss's clamped SwiGLU with alpha and limit.");
  bind_quant(m);
  bind_layer_ops(m);
  m.def("stream_read", [](uintptr_t data, size_t n_bytes, int threads) {
    py::gil_scoped_release release;
    return stream_read(reinterpret_cast<const void*>(data), n_bytes, threads);
  }, py::arg("data"), py::arg("n_bytes"), py::arg("threads"), "Read n_bytes with `threads` threads (a sum).");
  m.def("stream_copy", [](uintptr_t dst, uintptr_t src, size_t n_bytes, int threads) {
    py::gil_scoped_release release;
    stream_copy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n_bytes, threads);
  }, py::arg("dst"), py::arg("src"), py::arg("n_bytes"), py::arg("threads"), "memcpy split over threads.");
}
