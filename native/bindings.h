// What the binding files of engine._native share: the argument check, and each file's part of the
// module (bindings.cpp defines the module and calls the others).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "quant_blocks.h"

namespace py = pybind11;

namespace tandem {

inline void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

// A GGUF block type's code, checked against a row of k weights in w_row_bytes (bindings_quant.cpp).
QType checked_qtype(int type, int64_t k, int64_t w_row_bytes);

void bind_quant(py::module_& m);      // bindings_quant.cpp: products and lookups over GGUF blocks
void bind_layer_ops(py::module_& m);  // bindings_layer_ops.cpp: norms, RoPE

}  // namespace tandem
