// What the binding files of engine._native share: the argument check, and each file's part of the
// module (bindings.cpp defines the module and calls the others).
#pragma once

#include <pybind11/pybind11.h>

#include <stdexcept>

namespace py = pybind11;

namespace tandem {

inline void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

void bind_quant(py::module_& m);      // bindings_quant.cpp: products and lookups over GGUF blocks
void bind_layer_ops(py::module_& m);  // bindings_layer_ops.cpp: norms, RoPE

}  // namespace tandem
