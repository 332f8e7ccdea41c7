// The quantised-block kernels' part of engine._native (quant_blocks.h). The wrappers in engine/quant/
// check sizes against the tensors; here the type and the row layout are checked once more, so no bad
// stride reaches the kernels.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "interleaved16.h"
#include "quant_blocks.h"

namespace tandem {

QType checked_qtype(int type, int64_t k, int64_t w_row_bytes) {
  const int64_t bytes = qblock_bytes(type);
  if (bytes == 0) throw std::invalid_argument("unknown quantised block type " + std::to_string(type) +
                                              " (known: 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K, "
                                              "39 MXFP4)");
  const int64_t weights = qblock_weights(type);  // 32, or 256 for the K-quants
  require(k > 0 && k % weights == 0, "k must be a positive multiple of the type's block (32, K-quants 256)");
  require(w_row_bytes == k / weights * bytes, "w_row_bytes must be whole blocks of the type's size");
  return QType(type);
}

namespace {

// parts (P, 4) int64, a row per matrix: its blocks' address, type, rows and row bytes. Every part
// multiplies the same x (n_tokens, k); part i writes y's columns after those of the parts before it.
int quant_matmul_py(const py::array_t<int64_t, py::array::c_style>& parts, int64_t k, uintptr_t x,
                    int64_t n_tokens, int64_t x_stride, uintptr_t y, int64_t y_stride, int threads, bool interleave) {
  require(parts.ndim() == 2 && parts.shape(1) == 4, "parts must be an int64 table (P, 4): address, type, rows, row bytes");
  require(n_tokens >= 0 && x_stride >= k, "sizes and strides");
  const int64_t n_parts = parts.shape(0);
  std::vector<QuantMatmulProblem> problems;
  problems.reserve(size_t(n_parts));
  int64_t columns = 0;
  for (int64_t i = 0; i < n_parts; ++i) {
    const int64_t* r = parts.data() + 4 * i;
    const QType t = checked_qtype(int(r[1]), k, r[3]);
    require(r[2] >= 0, "a part's row count must be ≥ 0");
    if (r[2] == 0) continue;
    require(r[0] != 0, "null pointer");
    problems.push_back({reinterpret_cast<const uint8_t*>(r[0]), t, r[2], k, r[3], reinterpret_cast<const float*>(x),
                        n_tokens, x_stride, reinterpret_cast<float*>(y) + columns, y_stride});
    columns += r[2];
  }
  require(y_stride >= columns, "y_stride must cover every part's rows");
  std::vector<std::unique_ptr<InterleavedCopy>> copies;  // made for this call (tests, benchmarks)
  int n_interleaved = 0;
  if (interleave && active_quant_table().interleaved_rows)
    for (QuantMatmulProblem& p : problems) {
      copies.push_back(std::make_unique<InterleavedCopy>(p.w, p.type, p.n_rows, k, p.w_row_bytes));
      p.interleaved = copies.back()->view();
      n_interleaved += p.interleaved != nullptr;
    }
  if (problems.empty() || n_tokens == 0) return n_interleaved;
  require(x && y, "null pointer");
  py::gil_scoped_release release;
  quant_matmul(problems.data(), int(problems.size()), threads);
  return n_interleaved;
}

void quant_dequantize_py(uintptr_t w, int type, int64_t k, int64_t w_row_bytes, int64_t n_rows, int64_t row_begin,
                         int64_t row_end, const py::object& ids, uintptr_t out, int64_t out_stride, int threads,
                         bool bf16) {
  const QType t = checked_qtype(type, k, w_row_bytes);
  require(out_stride >= k, "out_stride must cover a row");
  const int64_t* id_ptr = nullptr;
  int64_t n_ids = 0;
  py::array_t<int64_t, py::array::c_style> id_array;
  if (!ids.is_none()) {
    id_array = ids.cast<py::array_t<int64_t, py::array::c_style>>();
    require(id_array.ndim() == 1, "ids must be 1-D int64");
    id_ptr = id_array.data(), n_ids = id_array.shape(0);
    for (int64_t i = 0; i < n_ids; ++i) require(id_ptr[i] >= 0 && id_ptr[i] < n_rows, "row id out of range");
  } else {
    require(0 <= row_begin && row_begin <= row_end && row_end <= n_rows, "row range out of bounds");
  }
  if ((id_ptr ? n_ids : row_end - row_begin) == 0) return;
  require(w && out, "null pointer");
  py::gil_scoped_release release;
  quant_dequantize(reinterpret_cast<const uint8_t*>(w), t, k, w_row_bytes, row_begin, row_end, id_ptr, n_ids,
                   reinterpret_cast<void*>(out), bf16, out_stride, threads);
}

}  // namespace

void bind_quant(py::module_& m) {
  m.def("quant_isa", [] { return std::string(active_quant_table().name); },
        "The instruction set the quantised-block kernels use now.");
  m.def("supported_quant_isas", [] {
    const char* names[4];
    const int n = supported_quant_isas(names, 4);
    return std::vector<std::string>(names, names + n);
  }, "Instruction sets this CPU can run the quantised-block kernels with, best first.");
  m.def("select_quant_isa", [](const std::string& name) { return select_quant_isa(name.c_str()); },
        py::arg("name"), "Use one ISA's quantised-block kernels ('auto': the best); False if unsupported.");
  m.def("quant_matmul", &quant_matmul_py, py::arg("parts").noconvert(), py::arg("k"), py::arg("x"),
        py::arg("n_tokens"), py::arg("x_stride"), py::arg("y"), py::arg("y_stride"), py::arg("threads"),
        py::arg("interleave") = false,
        "y (n_tokens, ΣN) fp32 = x (n_tokens, k) fp32 · [W₁; W₂; …]ᵀ, each W (N, k) in GGUF blocks (Q4_0/1, "
        "Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4), one row of `parts` each; the activations are quantised to "
        "int16 per 32-block once for all of them. interleave: the Q4_0/Q4_1 parts are first copied 16 rows at "
        "a time, as a decode layer's are, and one-token calls read the copies where the ISA has their kernel. "
        "Returns the parts read from such a copy.");
  m.def("quant_dequantize", &quant_dequantize_py, py::arg("w"), py::arg("type"), py::arg("k"),
        py::arg("w_row_bytes"), py::arg("n_rows"), py::arg("row_begin"), py::arg("row_end"), py::arg("ids"),
        py::arg("out"), py::arg("out_stride"), py::arg("threads"), py::arg("bf16") = false,
        "Rows of W (blocks) as fp32 (bf16, nearest even, with bf16=True) into out: rows [row_begin, row_end), "
        "or the rows `ids` (int64) in turn.");
}

}  // namespace tandem
