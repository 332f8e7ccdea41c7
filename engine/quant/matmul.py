"""Products over quantised blocks on the CPU: y = x · Wᵀ with W a `QuantTensor`, and row lookups.

Decode sizes (≤ NATIVE_MAX_TOKENS tokens; K-quants on AVX2 and AVX-512 more: `native_max_tokens`) go
to the native kernel (native/quant_kernels.h): the activations quantised per 32-block to int16, integer
dot products with the weight blocks (AVX-512 or AVX2 vpmaddwd; why not int8 is said there), the
weights read once per call at their quantised size. The K-quants are the exception: on AVX2 and
AVX-512 their activations are int8 per 256 values and a super-block's 8 sub-blocks sum in int32
(native/kquant_kernels.h).
More tokens (prefill) dequantise the weight a tile of rows at a time into fp32 and multiply with
torch's GEMM, which then beats the integer dots, whose cost grows with every token (figures below).

Measured on the development machine (2-core Zen 4, AVX-512), the built-in model's shapes: see
`NATIVE_MAX_TOKENS`. torch's own int4 kernel (`_weight_int4pack_mm_for_cpu`, groupsize
32, which Q4_0/Q4_1 map onto) took 8.2 ms for the 49152×576 output head at one token (1.7 GB/s of
int4) against 11.5 ms for fp32 `F.linear`; it repacks the weights (no view of the file) and has no
Q8_0 (its int8 kernel is per channel), so it is not used.

Without the extension everything dequantises with torch ops and runs `F.linear` (the stats say the
native kernels are missing).
"""

from __future__ import annotations

import functools
import time

import torch

from engine.errors import KernelInputError
from engine.kernels import native
from engine.quant import blocks
from engine.quant.blocks import BLOCK, QTYPES, QuantRows, QuantTensor, dequantize_rows

# Most tokens per call that the integer kernel takes; above it dequantised tiles + torch GEMM. One
# thread each, busy 2-core Zen 4 (load 7), the built-in model's shapes, µs, kernel / tiles + GEMM:
# 1536×576 Q4_1 at 8 tokens 694 / 1662, 16: 1283 / 1706, 32: 2552 / 1612; 49152×576 Q8_0 at 16
# 36241 / 47609, 32: 49386 / 42345. The integer kernel's cost grows with tokens (its int16 dots are
# compute), the GEMM's hardly does. The other types cross at the same count (load 1.7; 1536×576 Q5_0,
# 576×1536 Q4_K, Q6_K at 12 tokens 490, 490, 508 / 702, 752, 703; at 16 666, 685, 656 / 607, 627, 594;
# Q4_1 there 486 / 705, 643 / 580).
NATIVE_MAX_TOKENS = 16
# Where the K-quants take int8 activations (native/kquant_kernels.h) the integer kernel stays ahead
# of dequantised tiles + GEMM much longer. One thread, µs, kernel / tiles + GEMM:
# - AVX2 (2-core Zen 3, fp32 tiles): 768×2048 Q4_K at 16 tokens 757 / 1837, 32: 1561 / 2557, 64:
#   2943 / 3849, 96: 4212 / 5642; 2048×768 Q6_K at 32 1424 / 2343, 64: 2306 / 3398, 96: 4901 / 4459.
# - AVX-512 (2-core Xeon with AVX-512 BF16, no AMX; routed experts' bf16 tiles), a Q4_K_M file's
#   experts: 768×2048 Q4_K at 32 979 / 1739, 64: 1927 / 2857, 128: 4321 / 5436; 2048×768 Q6_K at 64
#   1998 / 3094. Its dense Q4_K 4096×2048 against fp32 tiles: 32: 5929 / 7705, 128: 21789 / 17626.
# A prefill's experts hold ~32 tokens each at 512. With AMX the tiles' GEMM runs on the matrix units
# and nothing has measured the crossover there: such CPUs keep NATIVE_MAX_TOKENS.
KQUANT_INT8_MAX_TOKENS = 64
INT8_KQUANT_ISAS = frozenset({"avx2", "avx512", "avx512vnni"})  # the native tables whose K-quants read int8
KQUANT_CODES = frozenset(t.code for t in QTYPES.values() if t.block_weights > BLOCK)  # super-blocks of 256
# Rows per dequantised tile in the prefill path: 2048 rows of 576 fp32 are 4.7 MB, within L2+L3 of a
# desktop CPU, so the GEMM reads the tile warm.
TILE_ROWS = 2048


def implementation(n_tokens: int = 1) -> str:
    """Which path quant_linear takes for n_tokens: 'native-<isa>', 'dequant-tiles' or 'torch'."""
    nat = native.module()
    if nat is None or not hasattr(nat, "quant_matmul"):
        return "torch"
    return f"native-{nat.quant_isa()}" if n_tokens <= NATIVE_MAX_TOKENS else "dequant-tiles"


def native_max_tokens(codes) -> int:
    """Most tokens a product over blocks of these type codes takes in the integer kernel before
    dequantised tiles and a GEMM are faster."""
    nat = blocks.native_quant()
    if nat is None:
        return 0
    if nat.quant_isa() in INT8_KQUANT_ISAS and KQUANT_CODES.issuperset(codes) and not _amx():
        return KQUANT_INT8_MAX_TOKENS
    return NATIVE_MAX_TOKENS


@functools.cache
def _amx() -> bool:
    """Whether this CPU has AMX (read once: the decode step asks native_max_tokens every layer)."""
    return "amx-bf16" in native.module().supported_isas()


def expert_tiles() -> torch.dtype:
    """What routed experts' prefill tiles are dequantised to and multiplied in: bf16 where the CPU
    multiplies bf16 in hardware (AMX or AVX-512 BF16) and torch's GEMM over an expert's tile is faster
    in bf16 than in fp32 there (timed once a process, `_bf16_gemm_faster`), else fp32. The bf16 tile is
    half the bytes to write, and the activations and products then round to bf16, as a GPU's BF16
    experts do; dense layers keep fp32 tiles (the built-in model's prefill stays its float32
    reference's). Neither dtype wins everywhere: on a Zen 4 the suite's cpu-moe-q4km-L8 prefill went
    from 158 to 195 tok/s with bf16 tiles (benchmarks/suite/cpu-moe-q4km-L8.json), while on a Xeon with
    AVX-512 BF16 and no AMX an expert's 768×2048 matrix at 128 tokens took 5155 µs in bf16 against 3242
    in fp32, dequantisation included (benchmarks/dev-2core/2026-12-07-avx512-int8-kquants/)."""
    global _EXPERT_TILES
    if _EXPERT_TILES is None:
        nat = native.module()  # the CPU's instruction sets as the extension found them, kernels hidden or not
        hardware = nat is not None and bool({"amx-bf16", "avx512bf16"} & set(nat.supported_isas()))
        _EXPERT_TILES = torch.bfloat16 if hardware and _bf16_gemm_faster() else torch.float32
    return _EXPERT_TILES


def _bf16_gemm_faster(tokens: int = 64, rows: int = 768, cols: int = 2048, repeats: int = 5) -> bool:
    """Whether torch multiplies a prefill tile of an expert's shape (Qwen3-30B-A3B's gate, 64 tokens)
    faster in bf16 than in fp32 on this CPU and its threads: the best of `repeats` each (~10 ms)."""
    def best(dtype: torch.dtype) -> float:
        x, w = torch.randn(tokens, cols).to(dtype), torch.randn(rows, cols).to(dtype)
        x @ w.t()  # the first call sets up torch's kernels
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x @ w.t()
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.inference_mode():
        return best(torch.bfloat16) < best(torch.float32)


_EXPERT_TILES: torch.dtype | None = None


def quant_linear(x: torch.Tensor, w: QuantTensor | QuantRows, bias: torch.Tensor | None = None,
                 tiles: torch.dtype = torch.float32) -> torch.Tensor:
    """x (…, K) float on the CPU, W (N, K) blocks → (…, N) in x's dtype (+ bias). W may be a QuantRows,
    several matrices' rows one after another (a layer's q, k and v): one kernel call then multiplies
    them all, the activations quantised once. tiles: the dtype of the dequantised tiles (and of x in
    their GEMM) above native_max_tokens' count, fp32 or bf16."""
    n_rows, cols = w.shape
    parts = w.parts if isinstance(w, QuantRows) else (w,)
    if not parts[0].blocks.is_cpu:  # blocks placed on a GPU: its kernels
        from engine.kernels import quant_linear_gpu

        if len(parts) > 1:
            y = torch.cat([quant_linear_gpu.linear(x, p) for p in parts], dim=-1)
            return y + bias if bias is not None else y
        return quant_linear_gpu.linear(x, w, bias)
    if not x.is_cpu or not x.is_floating_point() or x.shape[-1] != cols:
        raise KernelInputError(f"quant_linear takes a CPU float x (…, {cols}), got {x.dtype} "
                               f"{tuple(x.shape)} on {x.device}")
    n = x.numel() // cols
    nat = blocks.native_quant()
    if nat is not None and (n <= NATIVE_MAX_TOKENS or n <= native_max_tokens([p.qtype.code for p in parts])):
        # the decode step's call: a few µs of Python around the kernel matter at 100+ calls a token
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        y = torch.empty(*x.shape[:-1], n_rows)
        nat.quant_matmul(w.native_parts, cols, xf.data_ptr(), n, cols, y.data_ptr(), n_rows, native.threads())
    else:
        xt = x.reshape(n, cols).to(tiles)
        y = torch.empty(n, n_rows)
        first = 0  # this part's first column of y
        for part in parts:
            for a in range(0, part.shape[0], TILE_ROWS):
                b = min(part.shape[0], a + TILE_ROWS)
                y[:, first + a:first + b] = xt @ dequantize_rows(part, row_range=(a, b), dtype=tiles).t()  # (n, b − a)
            first += part.shape[0]
        y = y.view(*x.shape[:-1], n_rows)
    if bias is not None:
        y += bias
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def embedding(ids: torch.Tensor, w: QuantTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` (any shape, int) of W → (*ids.shape, K) in dtype: only those rows are dequantised."""
    on_gpu = w.blocks.device.type != "cpu"
    # (a graph being captured on the GPU cannot read the ids back; its ids come from the sampler)
    checked = not (on_gpu and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    if checked and ids.numel():
        low, high = torch.stack(torch.aminmax(ids)).tolist()  # one read back to the host, not two
        if low < 0 or high >= w.shape[0]:
            raise KernelInputError(f"token id out of range for an embedding of {w.shape[0]} rows")
    if on_gpu:
        from engine.kernels import quant_linear_gpu

        return quant_linear_gpu.embedding(ids, w, dtype)
    return dequantize_rows(w, rows=ids.reshape(-1)).to(dtype).reshape(*ids.shape, w.shape[1])
