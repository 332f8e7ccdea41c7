"""Builds the native CPU kernels (`native/`) into `engine._native`; everything else is in pyproject.toml.

setuptools (the project's existing backend) with pybind11's helpers: no CMake to fetch, and the
handful of C++ files compile in parallel. The extension does not link against torch: Python passes
data pointers, shapes and strides. Each ISA's kernels are compiled by their own file's target
pragma and chosen at run time, so the build never uses -march=native and the result runs on any
x86-64 (or other) CPU. The extension is optional: if no compiler is found the install still
succeeds and the engine runs its torch fallbacks (and says so in its stats).
"""

import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext, has_flag
from setuptools import setup

ParallelCompile("TANDEM_BUILD_JOBS", default=0).install()  # 0: one job per CPU


class BuildNative(build_ext):
    """Adds OpenMP where the compiler has it (without it the kernels run on one thread)."""

    def build_extensions(self):
        if self.compiler.compiler_type == "msvc":
            flags, link = ["/O2", "/openmp"], []
        else:
            flags, link = ["-O3"], []
            if has_flag(self.compiler, "-Wno-maybe-uninitialized"):  # GCC 12 trips over its own intrinsics
                flags.append("-Wno-maybe-uninitialized")
            if has_flag(self.compiler, "-fopenmp"):
                flags.append("-fopenmp")
                link.append("-fopenmp")
            else:
                print("tandem: the compiler has no OpenMP; native kernels will run single-threaded", file=sys.stderr)
        for ext in self.extensions:
            ext.extra_compile_args += flags
            ext.extra_link_args += link
        super().build_extensions()


native = Pybind11Extension(
    "engine._native",
    sorted(f"native/{name}" for name in ("bindings.cpp", "bindings_quant.cpp", "bindings_layer_ops.cpp", "layer_ops.cpp", "decode_layer.cpp",
                                         "dispatch.cpp", "isa_scalar.cpp", "isa_avx2.cpp",
                                         "isa_avx512.cpp", "isa_avx512bf16.cpp", "isa_amx.cpp",
                                         "moe_dispatch.cpp", "quant_dispatch.cpp",
                                         "isa_quant_scalar.cpp", "isa_quant_avx2.cpp", "isa_quant_avx512.cpp",
                                         "isa_quant_avx512vnni.cpp",
                                         "mla_dispatch.cpp", "isa_mla_scalar.cpp", "isa_mla_avx2.cpp",
                                         "isa_mla_avx512.cpp")),
    include_dirs=["native"],
    depends=[f"native/{h}" for h in ("common.h", "convert.h", "simd_avx512.h", "simd_avx2.h", "simd_scalar.h",
                                     "attention_kernel.h", "expert_activations.h", "experts_kernel.h",
                                     "amx_experts.h", "moe_worker.h", "routed_set.h", "cpu_mailbox.h", "quant_moe.h",
                                     "quant_blocks.h", "quant_kernels.h", "quant_vectors.h", "quant_int8_vectors.h",
                                     "kquant_blocks.h", "kquant_kernels.h", "attention_mla.h", "attention_mla_kernel.h",
                                     "attention_split.h", "lse_merge.h", "bindings.h", "layer_ops.h", "decode_layer.h",
                                     "interleaved16.h", "moe_route.h")],
    cxx_std=17,
    optional=True,
)

setup(ext_modules=[native], cmdclass={"build_ext": BuildNative})
