// layer_ops.h's and decode_layer.h's part of engine._native: fp32 tensors by address, shapes and
// strides; the Python side (engine/kernels/layer_ops_cpu.py, engine/runtime/cpu_decode.py) checks
// dtypes, devices and layouts first.
#include <pybind11/numpy.h>

#include <vector>

#include "bindings.h"
#include "decode_layer.h"
#include "layer_ops.h"

namespace tandem {

namespace {

using Int64s = py::array_t<int64_t, py::array::c_style>;  // tables and lists of int64

// quant_matmul's (P, 4) table (address, type, rows, row bytes) of matrices of k columns, checked
std::vector<BlockMatrix> block_matrices(const Int64s& parts, int64_t k) {
  require(parts.ndim() == 2 && parts.shape(1) == 4, "parts must be an int64 table (P, 4): address, type, rows, row bytes");
  std::vector<BlockMatrix> out;
  for (int64_t i = 0; i < parts.shape(0); ++i) {
    const int64_t* r = parts.data() + 4 * i;
    const QType t = checked_qtype(int(r[1]), k, r[3]);
    require(r[0] != 0 && r[2] > 0, "a part needs an address and rows");
    out.push_back({reinterpret_cast<const uint8_t*>(r[0]), t, r[2], r[3]});
  }
  return out;
}

template <class T> const T* ptr(uintptr_t a) { return reinterpret_cast<const T*>(a); }

}  // namespace

void bind_layer_ops(py::module_& m) {
  m.def("rms_norm", [](uintptr_t x, int64_t x_stride, uintptr_t w, uintptr_t out, int64_t out_stride, int64_t rows,
                       int64_t dim, double eps, int threads) {
    require(rows >= 0 && dim >= 1 && x_stride >= dim && out_stride >= dim, "sizes and strides");
    if (rows == 0) return;
    require(x && w && out, "null pointer");
    py::gil_scoped_release release;
    rms_norm(reinterpret_cast<const float*>(x), x_stride, reinterpret_cast<const float*>(w),
             reinterpret_cast<float*>(out), out_stride, rows, dim, float(eps), threads);
  }, py::arg("x"), py::arg("x_stride"), py::arg("w"), py::arg("out"), py::arg("out_stride"), py::arg("rows"),
        py::arg("dim"), py::arg("eps"), py::arg("threads"), "out (rows, dim) = RMSNorm of x with weight w, fp32.");
  m.def("add_rms_norm", [](uintptr_t x, uintptr_t r, uintptr_t w, uintptr_t h, uintptr_t out, int64_t rows,
                           int64_t dim, double eps, int threads) {
    require(rows >= 0 && dim >= 1, "sizes");
    if (rows == 0) return;
    require(x && r && w && h && out, "null pointer");
    py::gil_scoped_release release;
    add_rms_norm(reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(r),
                 reinterpret_cast<const float*>(w), reinterpret_cast<float*>(h), reinterpret_cast<float*>(out), rows,
                 dim, float(eps), threads);
  }, py::arg("x"), py::arg("r"), py::arg("w"), py::arg("h"), py::arg("out"), py::arg("rows"), py::arg("dim"),
        py::arg("eps"), py::arg("threads"), "h = x + r and out = RMSNorm(h), (rows, dim) contiguous fp32 each.");
  m.def("rope_rotate_half", [](uintptr_t x, int64_t tokens, int64_t token_stride, int64_t heads, int64_t head_dim,
                               int64_t rotary, uintptr_t cos, uintptr_t sin, int threads) {
    require(tokens >= 0 && heads >= 1 && rotary >= 2 && rotary % 2 == 0 && rotary <= head_dim,
            "tokens ≥ 0, heads ≥ 1, rotary even and within the head");
    require(token_stride >= heads * head_dim, "token_stride must cover the heads");
    if (tokens == 0) return;
    require(x && cos && sin, "null pointer");
    py::gil_scoped_release release;
    rope_rotate_half(reinterpret_cast<float*>(x), tokens, token_stride, heads, head_dim, rotary,
                     reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin), threads);
  }, py::arg("x"), py::arg("tokens"), py::arg("token_stride"), py::arg("heads"), py::arg("head_dim"),
        py::arg("rotary"), py::arg("cos"), py::arg("sin"), py::arg("threads"),
        "RoPE (rotate-half) in place on the first `rotary` dims of each head of x (tokens, heads, head_dim).");
  py::class_<DecodeLayer>(m, "DecodeLayer",
                          "A decoder layer's decode step for one token in one call (decode_layer.h). It keeps "
                          "the addresses it is built with: the caller keeps those tensors alive and in place.")
      .def(py::init([](int64_t dim, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t rotary,
                       int64_t ffn, int64_t kv_slots, double norm_eps, double qk_norm_eps, double scale, uintptr_t norm1,
                       uintptr_t norm2, uintptr_t q_norm, uintptr_t k_norm, const Int64s& qkv, uintptr_t qkv_bias,
                       const Int64s& o, const Int64s& gate_up, const Int64s& down, uintptr_t k_cache,
                       uintptr_t v_cache, int kv_dtype) {
             require(kv_dtype >= 0 && kv_dtype <= 2, "kv_dtype must be 0 (fp32), 1 (bf16) or 2 (fp16)");
             require(ffn >= 0, "ffn ≥ 0");
             DecodeLayerWeights w{ptr<float>(norm1), ptr<float>(norm2), ptr<float>(q_norm), ptr<float>(k_norm),
                                  block_matrices(qkv, dim), ptr<float>(qkv_bias), block_matrices(o, n_heads * head_dim),
                                  ffn ? block_matrices(gate_up, dim) : std::vector<BlockMatrix>{},
                                  ffn ? block_matrices(down, ffn) : std::vector<BlockMatrix>{},
                                  reinterpret_cast<void*>(k_cache), reinterpret_cast<void*>(v_cache), DType(kv_dtype)};
             require(kv_slots >= 1, "kv_slots ≥ 1");
             const DecodeLayerShape shape{dim, n_heads, n_kv_heads, head_dim, rotary, ffn, kv_slots, float(norm_eps),
                                          float(qk_norm_eps), float(scale)};
             return new DecodeLayer(shape, std::move(w));
           }),
           py::arg("dim"), py::arg("n_heads"), py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("rotary"),
           py::arg("ffn"), py::arg("kv_slots"), py::arg("norm_eps"), py::arg("qk_norm_eps"), py::arg("scale"), py::arg("norm1"),
           py::arg("norm2"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qkv").noconvert(), py::arg("qkv_bias"),
           py::arg("o").noconvert(), py::arg("gate_up").noconvert(), py::arg("down").noconvert(), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("kv_dtype"))
      .def("step", [](DecodeLayer& layer, uintptr_t x, uintptr_t normed, uintptr_t cos, uintptr_t sin,
                      const Int64s& write_rows, const Int64s& runs, const Int64s& offsets, int threads) {
             require(x && normed && cos && sin, "null pointer");
             require(write_rows.ndim() == 1 && write_rows.shape(0) >= 1, "write_rows must be int64 (B ≥ 1,)");
             const int64_t B = write_rows.shape(0);
             require(offsets.ndim() == 1 && offsets.shape(0) == B + 1, "offsets must be int64 (B + 1,)");
             require(runs.ndim() == 2 && runs.shape(1) == 2, "runs must be an int64 table (R, 2): first slot, count");
             const int64_t *r = runs.data(), *o = offsets.data(), *w = write_rows.data();
             require(o[0] == 0 && o[B] == runs.shape(0), "offsets must run from 0 to the runs' count");
             for (int64_t b = 0; b < B; ++b) {
               require(o[b] < o[b + 1], "every sequence needs a run");
               bool written = false;
               for (int64_t i = o[b]; i < o[b + 1]; ++i) {
                 require(r[2 * i] >= 0 && r[2 * i + 1] >= 1 && r[2 * i] + r[2 * i + 1] <= layer.kv_slots(),
                         "a run's slots must lie in the cache");
                 written |= r[2 * i] <= w[b] && w[b] < r[2 * i] + r[2 * i + 1];
               }
               require(written, "the written row must be one of the rows read");
             }
             py::gil_scoped_release release;
             return layer.step(reinterpret_cast<float*>(x), reinterpret_cast<float*>(normed), ptr<float>(cos), ptr<float>(sin),
                        B, w, r, o, threads);
           },
           py::arg("x"), py::arg("normed"), py::arg("cos"), py::arg("sin"), py::arg("write_rows").noconvert(),
           py::arg("runs").noconvert(), py::arg("offsets").noconvert(), py::arg("threads"),
           "B tokens, one a sequence: x (B, dim) fp32 ← the layer's output (without the FFN half: x + attention), "
           "normed ← norm₂(x + attention); cos, sin (B, rotary). Sequence b's cache rows are runs "
           "[offsets[b], offsets[b + 1]) of runs (R, 2) int64 (first slot, count), in order; its token's K and V "
           "go to write_rows[b]. Returns whether x has the FFN half (a MoE layer's: where set_routed gave its "
           "experts and B ≤ their max_tokens).")
      .def("set_routed", [](DecodeLayer& layer, uintptr_t router, int64_t n_experts, int64_t top_k, bool renormalise,
                            const Int64s& group, const Int64s& blocks, int gate_type, int up_type, int down_type,
                            int64_t inter, int64_t max_tokens) {
             require(group.ndim() == 1 && group.shape(0) == n_experts, "group must be int64 (E,)");
             require(blocks.ndim() == 2 && blocks.shape(1) == 3, "blocks must be an int64 table (G, 3): gate, up, down");
             require(inter >= 1 && max_tokens >= 1, "inter ≥ 1 and max_tokens ≥ 1");
             const int64_t dim = layer.dim();
             // an unknown type's row bytes 0: checked_qtype then names the type
             auto rows = [](int t, int64_t k) { return qblock_weights(t) ? k / qblock_weights(t) * qblock_bytes(t) : 0; };
             RoutedExperts r;
             r.router = ptr<float>(router), r.n_experts = n_experts, r.top_k = top_k, r.renormalise = renormalise;
             r.group.assign(group.data(), group.data() + n_experts);
             r.gate_type = checked_qtype(gate_type, dim, rows(gate_type, dim));
             r.up_type = checked_qtype(up_type, dim, rows(up_type, dim));
             r.down_type = checked_qtype(down_type, inter, rows(down_type, inter));
             r.inter = inter, r.max_tokens = max_tokens;
             for (int64_t g = 0; g < blocks.shape(0); ++g) {
               const int64_t* a = blocks.data() + 3 * g;
               require(a[0] && a[1] && a[2], "an expert without blocks");
               r.blocks.push_back({ptr<uint8_t>(uintptr_t(a[0])), ptr<uint8_t>(uintptr_t(a[1])),
                                   ptr<uint8_t>(uintptr_t(a[2])), 0});
             }
             layer.set_routed(std::move(r));
           },
           py::arg("router"), py::arg("n_experts"), py::arg("top_k"), py::arg("renormalise"), py::arg("group").noconvert(),
           py::arg("blocks").noconvert(), py::arg("gate_type"), py::arg("up_type"), py::arg("down_type"), py::arg("inter"),
           py::arg("max_tokens"),
           "A MoE layer's router (E, dim) fp32 by address, softmax then top-k (renormalised or not), and its quantised "
           "experts: group (E,) each expert's row of blocks (G, 3) (gate, up, down addresses, GGUF rows), the three "
           "block types, the experts' width. step then routes normed and adds the experts' output to x itself.")
      .def_property_readonly("has_ffn", &DecodeLayer::has_ffn);
}

}  // namespace tandem
