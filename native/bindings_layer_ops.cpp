// layer_ops.h's part of engine._native: fp32 tensors by address, shapes and strides; the Python
// side (engine/kernels/layer_ops_cpu.py) checks dtypes, devices and layouts first.
#include "bindings.h"
#include "layer_ops.h"

namespace tandem {

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
}

}  // namespace tandem
