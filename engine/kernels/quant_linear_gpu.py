"""Dense layers over GGUF blocks on the GPU: y = x · Wᵀ (+ b) and embedding rows, W a `QuantTensor`
whose blocks are on the device (engine/quant/matmul.py sends them here).

A few tokens (decode) are a matrix-vector product per token, bound by the weight bytes it reads: one
Triton kernel reads each row's blocks once and decodes them in registers (quant_moe_gpu's `_gemv`,
dequant_gpu's decoding), no dequantised copy, no host sync (a decode graph captures it). More tokens
(prefill) dequantise W a chunk of rows at a time into a tile of x's dtype (dequant_gpu) for the GEMM,
which then runs at tensor-core speed; a chunk is at most CHUNK_BYTES, so the 151936-row output head of
Qwen3 never costs its 622 MB in BF16 at once. An embedding lookup dequantises only the rows it reads.

    linear(x, w, bias) -> y        x (…, K) bf16/fp16/fp32 on w's device; w (N, K); y (…, N) in x's dtype
    embedding(ids, w, dtype) -> e  ids (…) int on w's device → (…, K) in dtype
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.kernels import dequant_gpu, quant_moe_gpu

try:
    import triton
    import triton.language as tl

    from engine.kernels.quant_moe_gpu import _gemv
except ImportError:
    triton = None

MAX_TOKENS = 8  # above this the tokens share each dequantised tile: the GEMM reads it once for all of them
# Rows a program and sub-blocks of 32 weights a row a step: 4 × 32, 128 sub-blocks a step, so a row of
# 2,048 weights is 2 steps. A decode GEMV waits on memory once a step and has too few programs to hide
# it, so fewer, wider steps: the fastest setting of `python3 -m engine.bench.quant_gpu`'s sweep on an
# H100 (o_proj 2048×4096 Q4_K 10.1 µs against 13.3 at 8 × 8, q_proj 4096×2048 10.1 against 10.5, the
# Q6_K output head 320 against 330; benchmarks/h200/2026-12-06-q4km-h100/quant-gpu.json).
ROWS, CHUNK = 4, 32
WARPS = 4  # Triton's default (quant_moe_gpu's WARPS)
ROWS_INTERPRETED = 64  # Triton's interpreter pays per operation, not per element: taller tiles, same code
CHUNK_BYTES = 64 << 20  # a prefill's dequantised tile of W: 16K rows of 2048 in bf16


log = logging.getLogger("tandem")
_WORKS: dict[str, bool] = {}  # device → whether the kernels over blocks ran right there (once a process)


def available(device: torch.device) -> bool:
    """Triton importable and a CUDA device, or the interpreter (CPU tensors: the tests)."""
    return triton is not None and (torch.device(device).type == "cuda" or dequant_gpu.interpreted())


def works(device: torch.device) -> bool:
    """Whether the GPU kernels over blocks (these and quant_moe_gpu's) compile and compute right on this
    device: a tiny Q8_0 product of each, once a process. Where they do not (a Triton, driver or GPU this
    code has not met), the engine keeps its dequantised paths for the run, with one warning, rather
    than fail the load or a reply."""
    device = torch.device(device)
    key = str(device)
    if key not in _WORKS:
        try:
            _WORKS[key] = available(device) and _self_test(device)
        except Exception as e:  # a kernel that does not compile or launch here
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            log.warning("the GPU kernels over quantised blocks failed on %s (%s: %s): weights and experts "
                        "are dequantised there instead", device, type(e).__name__, first)
            _WORKS[key] = False
    return _WORKS[key]


def _self_test(device: torch.device) -> bool:
    """Q8_0 blocks of weights 1 (d = 1, q = 1): a (4, 32) product of ones gives 32 in every row; an expert
    of three (32, 32) parts of them gives 32 · SiLU(32) · 32 = 32768 (exact in bf16)."""
    from engine.quant.blocks import QuantTensor

    block = torch.tensor([0x00, 0x3C] + [1] * 32, dtype=torch.uint8)  # fp16 1.0, then 32 int8 ones
    w = QuantTensor(block.repeat(4, 1).to(device), 8, (4, 32), "self-test")
    y = linear(torch.ones(1, 32, device=device, dtype=torch.bfloat16), w)
    pool = block.repeat(1, 3 * 32).to(device)  # (1, 3 · 32 rows · 34 bytes): gate, up, down
    row = 32 * 34
    out = quant_moe_gpu.moe_decode_quant(torch.ones(1, 32, device=device, dtype=torch.bfloat16),
                                         torch.zeros(1, 1, dtype=torch.int64, device=device),
                                         torch.ones(1, 1, device=device, dtype=torch.bfloat16), pool,
                                         ((8, 0), (8, row), (8, 2 * row)), 32)
    good = bool((y.float() == 32).all()) and bool((out.float() == 32768).all())
    if not good:
        log.warning("the GPU kernels over quantised blocks computed wrong values on %s: weights and experts "
                    "are dequantised there instead", device)
    return good


if triton is not None:

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, row_bytes, QT: tl.constexpr, BB: tl.constexpr,
                       HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, C: tl.constexpr):
        """Program (row tile, token m): out[m, rows] = W[rows] · x[m] (+ bias), fp32 sums rounded once. Row
        tiles on grid axis 0 (up to 2^31 − 1; axis 1 stops at 65,535: 131K rows in tiles of 2)."""
        m = tl.program_id(1)
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS * C) // C  # (ROWS·C,) row of each sub-block slot
        acc = _gemv(x_ptr + m * K, w_ptr + r.to(tl.int64) * row_bytes, r < N, K // 32, QT, BB, ROWS, C)  # (ROWS,)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * N + rows, acc.to(out_ptr.dtype.element_ty), mask=rows < N)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (…, K) float on w's device, w a QuantTensor (N, K) with device blocks → (…, N) in x's dtype."""
    N, K = w.shape
    if x.device != w.blocks.device or not x.is_floating_point() or x.shape[-1] != K:
        raise ValueError(f"x must be a float (…, {K}) on {w.blocks.device}; got {x.dtype} {tuple(x.shape)} on {x.device}")
    if K % 32:
        raise ValueError(f"rows of {K} weights are not whole 32-weight blocks")
    n = x.numel() // K
    x2 = x.reshape(n, K).contiguous()
    if n <= MAX_TOKENS:
        y = torch.empty(n, N, dtype=x.dtype, device=x.device)
        if n:
            rows = ROWS_INTERPRETED if dequant_gpu.interpreted() else ROWS
            _linear_kernel[(triton.cdiv(N, rows), n)](x2, w.blocks, bias if bias is not None else x2, y, N, K,
                                                      w.row_bytes, QT=w.qtype.code, BB=w.qtype.block_bytes,
                                                      HAS_BIAS=bias is not None, ROWS=rows, C=CHUNK, num_warps=WARPS)
        return y.view(*x.shape[:-1], N)
    per_chunk = max(1, min(N, CHUNK_BYTES // (K * x.element_size())))
    tile = torch.empty(per_chunk, K, dtype=x.dtype, device=x.device)  # (R, K) dequantised rows of W
    first = torch.zeros(1, dtype=torch.int64, device=x.device)  # the tile is one "slot" of the dequantiser
    y = torch.empty(n, N, dtype=x.dtype, device=x.device)
    for a in range(0, N, per_chunk):
        b = min(N, a + per_chunk)
        rows = tile[:b - a]
        dequant_gpu.dequantize_into(rows.view(1, -1), first, w.blocks[a:b].reshape(1, -1), w.qtype.code, 0)
        y[:, a:b] = F.linear(x2, rows, None if bias is None else bias[a:b])  # (n, b − a)
    return y.view(*x.shape[:-1], N)


def embedding(ids: torch.Tensor, w, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (any shape, int, on w's device) of W → (*ids.shape, K) in dtype: only they dequantise."""
    flat = ids.reshape(-1).long()
    n, K = flat.numel(), w.shape[1]
    out = torch.empty(n, K, dtype=dtype, device=w.blocks.device)
    if n:
        dequant_gpu.dequantize_into(out, torch.arange(n, device=out.device), w.blocks.index_select(0, flat),
                                    w.qtype.code, 0)
    return out.view(*ids.shape, K)
