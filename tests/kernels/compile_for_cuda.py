"""Compiles the Triton kernels over GGUF blocks for a CUDA target (sm_90) without a GPU, every block type
and every constexpr form the engine launches: a kernel that Triton's interpreter runs (the CPU tests)
can still fail to compile for a device. Run as a script, outside the interpreter (the jit functions
must be compiled, not interpreted); prints one line per failure and exits 1 if any."""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "compile with the interpreter off"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.kernels import dequant_gpu, quant_linear_gpu, quant_moe_gemm_gpu, quant_moe_gpu  # noqa: E402
from engine.quant.blocks import QTYPES, qtype  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100/H200: the GPU machine's
POINTERS = {"slots_ptr": "*i64", "ids_ptr": "*i64", "offs_ptr": "*i64", "spare_ptr": "*i64", "experts_ptr": "*i64",
            "blocks_ptr": "*u8", "pool_ptr": "*u8", "w_ptr": "*u8",
            "row_of_ptr": "*i64", "pair_ptr": "*i64", "block_expert_ptr": "*i64", "n_rows_ptr": "*i64",
            "pairs_ptr": "*fp32"}  # the rest: the activations' bf16
FLOATS = ("alpha", "limit")


def compiled(fn, divisible: bool = False, types: dict | None = None, **constexprs):
    """fn compiled for TARGET with these constexprs (other arguments: pointers per POINTERS, fp32 or
    i32 scalars) → Triton's compiled kernel (its PTX in .asm["ptx"]). divisible: every pointer and
    integer argument marked a multiple of 16, as Triton's launcher marks the ones that are (the row
    lengths and offsets of the GGUF shapes here are); types: arguments' types that differ from those."""
    names = [p.name for p in fn.params]
    signature = {n: "constexpr" if n in constexprs else POINTERS.get(n, "*bf16") if n.endswith("_ptr")
                 else "fp32" if n in FLOATS else "i32" for n in names}
    signature.update({n: t for n, t in (types or {}).items() if n in signature})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if divisible and (signature[n] == "i32" or signature[n].startswith("*"))}
    return triton.compile(ASTSource(fn, signature, {(names.index(k),): v for k, v in constexprs.items()}, attrs),
                          target=TARGET)


def compile_kernel(fn, types: dict | None = None, **constexprs) -> str | None:
    """fn compiled for TARGET (`compiled`) → None, or the error's first lines."""
    try:
        compiled(fn, types=types, **constexprs)
    except Exception as e:
        return f"{type(e).__name__}: {' | '.join(str(e).strip().splitlines()[:6])}"
    return None


def failures():
    for code in sorted(QTYPES):
        qt = qtype(code)
        k = qt.name in dequant_gpu.KQUANTS
        for bf16 in (True, False):
            yield f"dequantise {qt.name} bf16={bf16}", compile_kernel(
                dequant_gpu._dequant_k_kernel if k else dequant_gpu._dequant32_kernel, QT=code, BB=qt.block_bytes,
                BF16_BITS=bf16, ROWS=dequant_gpu.ROWS)
        for bias in (True, False):
            yield f"linear {qt.name} bias={bias}", compile_kernel(
                quant_linear_gpu._linear_kernel, QT=code, BB=qt.block_bytes, HAS_BIAS=bias,
                ROWS=quant_linear_gpu.ROWS, C=quant_linear_gpu.CHUNK)
        # the slots' form, the one graph's (offsets and spare slots), gpt-oss's clamped form in both
        for offs, spare, clamped in ((False, False, False), (True, True, False), (False, False, True), (True, True, True)):
            flags = dict(HAS_OFFS=offs, HAS_SPARE=spare, CLAMPED=clamped, C=quant_moe_gpu.CHUNK,
                         COPY=quant_moe_gpu.COPY_BYTES)
            form = f"{qt.name} offsets={offs} spare={spare} clamped={clamped}"
            yield f"gate_up {form}", compile_kernel(quant_moe_gpu._gate_up_kernel, QG=code, BG=qt.block_bytes,
                                                    QU=code, BU=qt.block_bytes, ROWS=quant_moe_gpu.ROWS_GATE_UP,
                                                    **flags)
            yield f"down {form}", compile_kernel(quant_moe_gpu._down_kernel, QD=code, BD=qt.block_bytes,
                                                 ROWS=quant_moe_gpu.ROWS_DOWN, **flags)
        # the prefill GEMMs over blocks, bf16 activations on the tensor cores for every type; gpt-oss's form
        # and fp32 activations (full fp32 products) on one type each: the decoding is the same code
        forms = [(False, False)] + [(True, False)] * (qt.name == "MXFP4") + [(False, True)] * (qt.name == "Q4_K")
        for clamped, ieee in forms:
            tile = dict(CLAMPED=clamped, IEEE=ieee, BM=quant_moe_gemm_gpu.BM, BN=quant_moe_gemm_gpu.BN,
                        SUB=quant_moe_gemm_gpu.SUB)
            form = f"{qt.name} clamped={clamped} ieee={ieee}"
            types = {n: "*fp32" for n in ("x_ptr", "act_ptr", "wts_ptr")} if ieee else None
            yield f"gate_up GEMM {form}", compile_kernel(quant_moe_gemm_gpu._gate_up_gemm, types, QG=code,
                                                         BG=qt.block_bytes, QU=code, BU=qt.block_bytes, **tile)
            yield f"down GEMM {form}", compile_kernel(quant_moe_gemm_gpu._down_gemm, types, QD=code,
                                                      BD=qt.block_bytes, **tile)


if __name__ == "__main__":
    bad = [(what, error) for what, error in failures() if error is not None]
    for what, error in bad:
        print(f"{what}: {error}")
    print(f"{len(bad)} failed")
    sys.exit(1 if bad else 0)
