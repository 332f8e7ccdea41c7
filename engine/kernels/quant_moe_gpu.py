"""Routed experts for a few tokens computed straight over GGUF-quantised cache slots: three Triton kernels.

A cache slot that keeps an expert as the file's blocks instead of a dequantised copy holds it in a
fraction of the bytes (Q4_K: 144 bytes a 256 weights against 512 in bf16). At decode (1–8 tokens)
each (token, choice) pair is a matrix-vector product, bound by the bytes it reads, so the kernels here
read each chosen expert's blocks once and decode them in registers (engine/kernels/dequant_gpu.py's
`_values32` and `_values_k`, the fill kernels' own decoding), never writing a dequantised copy:

  1. gate_up: program (pair p, ROWS rows of I) computes the gate and up rows of slot ids[p] for token
     p // k and writes act[p] = SiLU(gate) · up, (P, I);
  2. down: program (pair p, ROWS rows of H) writes y[p] = weights[p] · down[ids[p]] @ act[p], (P, H);
  3. moe_decode_gpu's sum over each token's k choices in fp32 writes out (N, H).

    moe_decode_quant(x, ids, weights, pool, parts, expert_ffn) -> out
        x (N, H) bf16/fp16/fp32; ids (N, k) int64 slot per pair (outside [0, S): skipped);
        weights (N, k) in x's dtype; pool (S, B) uint8, slot s = [gate (I, H) | up (I, H) | down (H, I)]
        rows of GGUF blocks, part i of type parts[i][0] at byte parts[i][1] of the slot; out (N, H)

A program walks along K C sub-blocks of 32 weights of each of its rows at a time: one flattened
(ROWS·C,) vector of sub-blocks whose byte addresses are arithmetic (row start + the sub-block's block
or super-block), decoded to (ROWS·C, 32) values, multiplied by the matching 32 inputs and summed per
sub-block; the (ROWS·C,) partial sums become (ROWS, C) and a row's dot product at the end. Gate, up
and down may each be of another type (Q4_K_M files give down Q6_K): the type codes are constexpr,
one compiled kernel per layout.

Numerics follow moe_decode_gpu's kernels over dequantised slots: the decoded weights are gguf's in
fp32, products accumulate in fp32, gate and up are rounded to x's dtype, SiLU(gate) too, act is stored
in it; down's output is rounded to the dtype, weighted in the dtype, and the k choices are summed in
fp32. Nothing is read back to the host, so a CUDA graph can capture the three launches.
"""

from __future__ import annotations

import torch

from engine.kernels import dequant_gpu, moe_decode_gpu
from engine.quant.blocks import QTYPES, qtype

try:
    import triton
    import triton.language as tl

    from engine.kernels.dequant_gpu import _sub_blocks
except ImportError:
    triton = None

# Rows a program: I/8 and H/8 programs a pair, many for one token, so that every multiprocessor has
# loads in flight; and 8 sub-blocks (a K-quant super-block) a row per step: 64 sub-blocks a step (gate_up:
# 2 × 64). The fastest of `python3 -m engine.bench.quant_gpu`'s sweep on an H100 (Q4_K/Q4_K/Q6_K, one
# token: 45.7 µs against 48.9 for gate_up rows of 4; benchmarks/h200/2026-12-05-q4km-blocks-h100).
# WARPS: Triton's default. Activations in int16 with dp2a products halved the instructions a weight
# and left 8 experts at 42–44 µs (benchmarks/h200/2026-12-05-int16-dot-h100): a program's loop waits on
# memory once an iteration, so the iterations a program makes are the lever the bench's sweep explores.
ROWS_GATE_UP, ROWS_DOWN, CHUNK, WARPS = 8, 8, 8, 4
COPY_BYTES = 256  # a pair that fills a slot copies its rows this many bytes a step (a row: 0.4–2.3 KB)
# Triton's interpreter runs programs one after another and pays per operation, not per element: few
# programs of many rows keep the tests fast. The code is the same; only the tile is taller.
ROWS_INTERPRETED = 64


def available(x: torch.Tensor) -> bool:
    """Triton importable and x on a CUDA device, or Triton's interpreter (CPU tensors)."""
    return triton is not None and (x.is_cuda or dequant_gpu.interpreted())


if triton is not None:

    @triton.jit
    def _gemv(vec, rows, row_ok, n_sub, QT: tl.constexpr, BB: tl.constexpr, ROWS: tl.constexpr,
              C: tl.constexpr):
        """Dot products of ROWS matrix rows of type QT (ggml's code, BB bytes a block) with the vector at
        `vec` (K = 32·n_sub elements): rows (ROWS·C,) are the start pointers of the row each of the C
        sub-block slots a row belongs to, row_ok (ROWS·C,) masks them → (ROWS,) fp32."""
        c = tl.arange(0, ROWS * C) % C  # (ROWS·C,) slot within its row
        l = tl.arange(0, 32)  # (32,) weight within a sub-block
        acc = tl.zeros((ROWS * C,), tl.float32)
        for k0 in range(0, n_sub, C):
            kb = k0 + c  # (ROWS·C,) sub-block along the row
            ok_v = row_ok & (kb < n_sub)
            ok = ok_v[:, None] & (l[None, :] < 32)  # (ROWS·C, 32)
            w = _sub_blocks(rows, kb, ok_v, l, ok, QT, BB)  # (ROWS·C, 32)
            v = tl.load(vec + kb[:, None] * 32 + l[None, :], mask=ok, other=0.0).to(tl.float32)  # (ROWS·C, 32)
            acc += tl.sum(w * v, 1)
        return tl.sum(tl.reshape(acc, (ROWS, C)), 1)  # (ROWS,): row-major, so slot v is row v // C

    @triton.jit
    def _activation(gate, up, gate_bias, up_bias, alpha, limit, dtype: tl.constexpr, CLAMPED: tl.constexpr):
        """fp32 sums of the gate and up rows (and with CLAMPED their fp32 biases) → the down projection's
        input in fp32, rounded where F.linear and the reference round: SiLU(gate) · up, or gpt-oss's
        (clamp(u, ±limit) + 1) · g'·σ(alpha·g') with g' = min(g, limit)."""
        if CLAMPED:
            gate = (gate + gate_bias).to(dtype).to(tl.float32)
            up = (up + up_bias).to(dtype).to(tl.float32)
            g = tl.minimum(gate, limit)
            u = tl.minimum(tl.maximum(up, -limit), limit)
            act = (u + 1.0) * g / (1.0 + tl.exp(-alpha * g))
        else:
            gate = gate.to(dtype).to(tl.float32)  # F.linear's rounding
            up = up.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
        return act

    @triton.jit
    def _part_rows(pool_ptr, ids_ptr, offs_ptr, spare_ptr, E, stride_slot, n, offset, row_bytes,
                   HAS_OFFS: tl.constexpr, HAS_SPARE: tl.constexpr, ROWS: tl.constexpr, C: tl.constexpr,
                   COPY: tl.constexpr):
        """Pair program_id(0)'s part at `offset` of its expert's block, n rows of row_bytes: → (start
        pointer of each sub-block slot's row (ROWS·C,), which of them to read (ROWS·C,)) for row tile
        program_id(1). The block is slot ids[p] of the pool, or with HAS_OFFS `offs[ids[p]]` bytes past
        the pool's start (a slot, or the pinned host store read over PCIe). With HAS_SPARE a pair whose
        spare[p] ≥ 0 first copies the tile's rows there (COPY bytes a step) and reads them from the copy."""
        p = tl.program_id(0)
        e = tl.load(ids_ptr + p)
        valid = (e >= 0) & (e < E)
        n_rows = tl.where(valid, n, 0)  # a skipped pair reads nothing: its sums stay zero
        e_ok = tl.where(valid, e, 0)  # an in-range index for the address
        block = tl.load(offs_ptr + e_ok) if HAS_OFFS else e_ok * stride_slot  # bytes past the pool's start
        if HAS_SPARE:
            sp = tl.load(spare_ptr + p)
            rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # (ROWS,) this tile's rows
            copy_ok = rows < tl.where(sp >= 0, n_rows, 0)
            dest = tl.where(sp >= 0, sp, 0)
            b = tl.arange(0, COPY)
            for b0 in range(0, row_bytes, COPY):
                at = offset + rows.to(tl.int64)[:, None] * row_bytes + (b0 + b)[None, :]  # (ROWS, COPY)
                m = copy_ok[:, None] & ((b0 + b)[None, :] < row_bytes)
                tl.store(pool_ptr + dest + at, tl.load(pool_ptr + block + at, mask=m), mask=m)
            tl.debug_barrier()  # the copy is written before the program reads it back
            block = tl.where(sp >= 0, sp, block)  # one read over the link: the rest from the slot
        r = tl.program_id(1) * ROWS + tl.arange(0, ROWS * C) // C  # (ROWS·C,) row of each slot
        start = pool_ptr + block + offset + r.to(tl.int64) * row_bytes
        return start, r < n_rows

    @triton.jit
    def _gate_up_kernel(x_ptr, pool_ptr, ids_ptr, offs_ptr, spare_ptr, act_ptr, experts_ptr, bias_ptr, alpha, limit,
                        H, I, E, top_k, stride_slot, off_g, row_g, off_u, row_u, QG: tl.constexpr, BG: tl.constexpr,
                        QU: tl.constexpr, BU: tl.constexpr, HAS_OFFS: tl.constexpr, HAS_SPARE: tl.constexpr,
                        CLAMPED: tl.constexpr, ROWS: tl.constexpr, C: tl.constexpr, COPY: tl.constexpr):
        p = tl.program_id(0)  # (token, choice) pair
        x_row = x_ptr + (p // top_k) * H
        gate_rows, ok = _part_rows(pool_ptr, ids_ptr, offs_ptr, spare_ptr, E, stride_slot, I, off_g, row_g,
                                   HAS_OFFS, HAS_SPARE, ROWS, C, COPY)
        up_rows, _ = _part_rows(pool_ptr, ids_ptr, offs_ptr, spare_ptr, E, stride_slot, I, off_u, row_u,
                                HAS_OFFS, HAS_SPARE, ROWS, C, COPY)
        dtype = act_ptr.dtype.element_ty
        gate = _gemv(x_row, gate_rows, ok, H // 32, QG, BG, ROWS, C)  # (ROWS,) fp32
        up = _gemv(x_row, up_rows, ok, H // 32, QU, BU, ROWS, C)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
        if CLAMPED:  # the pair's expert's (2I,) gate_up bias
            e = tl.load(ids_ptr + p)
            valid = (e >= 0) & (e < E)  # a skipped pair's expert id may be anything: no bias is read for it
            bias = bias_ptr + tl.where(valid, tl.load(experts_ptr + p), 0) * 2 * I
            b_ok = rows < tl.where(valid, I, 0)
            gate_bias = tl.load(bias + rows, mask=b_ok, other=0.0).to(tl.float32)
            up_bias = tl.load(bias + I + rows, mask=b_ok, other=0.0).to(tl.float32)
        else:
            gate_bias, up_bias = 0.0, 0.0
        act = _activation(gate, up, gate_bias, up_bias, alpha, limit, dtype, CLAMPED)
        tl.store(act_ptr + p * I + rows, act.to(dtype), mask=rows < I)

    @triton.jit
    def _down_kernel(act_ptr, pool_ptr, ids_ptr, offs_ptr, spare_ptr, wts_ptr, y_ptr, experts_ptr, bias_ptr, H, I, E,
                     stride_slot, off_d, row_d, QD: tl.constexpr, BD: tl.constexpr, HAS_OFFS: tl.constexpr,
                     HAS_SPARE: tl.constexpr, CLAMPED: tl.constexpr, ROWS: tl.constexpr, C: tl.constexpr,
                     COPY: tl.constexpr):
        p = tl.program_id(0)  # (token, choice) pair
        down_rows, ok = _part_rows(pool_ptr, ids_ptr, offs_ptr, spare_ptr, E, stride_slot, H, off_d, row_d,
                                   HAS_OFFS, HAS_SPARE, ROWS, C, COPY)
        dtype = y_ptr.dtype.element_ty
        y = _gemv(act_ptr + p * I, down_rows, ok, I // 32, QD, BD, ROWS, C)  # (ROWS,) fp32
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # (ROWS,) output features
        if CLAMPED:  # the pair's expert's (H,) down bias, inside F.linear's one rounding; none for a skipped pair
            e = tl.load(ids_ptr + p)
            valid = (e >= 0) & (e < E)
            bias = bias_ptr + tl.where(valid, tl.load(experts_ptr + p), 0) * H
            y += tl.load(bias + rows, mask=rows < tl.where(valid, H, 0), other=0.0).to(tl.float32)
        y = y.to(dtype).to(tl.float32)
        w = tl.load(wts_ptr + p).to(tl.float32)
        tl.store(y_ptr + p * H + rows, (y * w).to(dtype), mask=rows < H)  # weighted in the model dtype


def _check(x, ids, weights, pool, parts, expert_ffn, out) -> list[tuple[int, int, int, int]]:
    """Refuses misshapen arguments → per part (type code, block bytes, byte offset, row bytes)."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be (N, H) bf16, fp16 or fp32; got {tuple(x.shape)} {x.dtype}")
    N, H = x.shape
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != N:
        raise ValueError(f"ids must be ({N}, k) int64; got {tuple(ids.shape)} {ids.dtype}")
    if weights.shape != ids.shape or weights.dtype != x.dtype:
        raise ValueError(f"weights must be {tuple(ids.shape)} {x.dtype}; got {tuple(weights.shape)} {weights.dtype}")
    if pool.dtype != torch.uint8 or pool.dim() != 2 or (pool.shape[1] > 1 and pool.stride(1) != 1):
        raise ValueError(f"pool must be (S, B) uint8 with contiguous rows; got {tuple(pool.shape)} {pool.dtype}")
    if len({t.device for t in (x, ids, weights, pool)}) != 1:
        raise ValueError("x, ids, weights and pool must be on one device")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be contiguous {tuple(x.shape)} {x.dtype}")
    if len(parts) != 3:
        raise ValueError(f"parts must be (gate, up, down) (type code, byte offset) pairs; got {parts!r}")
    specs = []
    for name, (code, offset), (rows, cols) in zip(("gate", "up", "down"), parts,
                                                  ((expert_ffn, H), (expert_ffn, H), (H, expert_ffn))):
        if int(code) not in QTYPES:
            raise ValueError(f"{name}: block type {code} is not one of the kept GGUF types")
        qt = qtype(int(code))
        if cols <= 0 or cols % qt.block_weights:
            raise ValueError(f"{name}: rows of {cols} weights are not whole {qt.name} blocks of {qt.block_weights}")
        row_bytes = cols // qt.block_weights * qt.block_bytes
        if offset < 0 or offset + rows * row_bytes > pool.shape[1]:
            raise ValueError(f"{name}: {rows} {qt.name} rows of {row_bytes} bytes at byte {offset} do not fit "
                             f"slots of {pool.shape[1]} bytes")
        specs.append((qt.code, qt.block_bytes, int(offset), row_bytes))
    return specs


def moe_decode_quant(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor,
                     parts, expert_ffn: int, out: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                     spare: torch.Tensor | None = None, admit: bool = False, cpu: tuple | None = None,
                     form=None, experts: torch.Tensor | None = None) -> torch.Tensor:
    """x (N, H) bf16/fp16/fp32; ids (N, k) int64: slot index of each (token, choice) pair in `pool`,
    an id outside [0, S) skips that pair (adds zero, reads nothing: the caller marks pairs the CPU
    computes so); weights (N, k) in x's dtype; pool (S, B) uint8, rows contiguous: slot s holds one
    expert's blocks [gate (I, H) rows | up (I, H) rows | down (H, I) rows] in GGUF block formats;
    parts = ((gate type code, gate byte offset), (up code, up offset), (down code, down offset)) within
    a slot row; expert_ffn = I; out (N, H), optional: written instead of a new tensor → out (N, H) in
    x's dtype. Three launches on the current stream, nothing read back to the host.

    The whole-step graph's form (engine/experts/zero_copy.py), as moe_decode's: offsets (E,) int64: ids
    are expert ids and expert e's block starts offsets[e] bytes past the pool's start (a slot, or the
    pinned host store, read in place); spare (N·k,) int64: the byte offset of a free slot pair p copies
    the blocks it reads into (-1: none), read back from there; admit: the sum then points each filled
    expert's entry of offsets at its slot; cpu: the CPU mailbox's wait arguments (moe_decode's).

    form: gpt-oss's experts (experts_torch.ClampedSwiGLU, its biases (E, 2I) and (E, H) on the device):
    each pair adds its expert's biases and takes the clamped activation; experts (N, k) int64 gives each
    pair's expert id where ids are slots (None: ids are the expert ids)."""
    (qg, bg, off_g, row_g), (qu, bu, off_u, row_u), (qd, bd, off_d, row_d) = _check(
        x, ids, weights, pool, parts, expert_ffn, out)
    assert not admit or (offsets is not None and spare is not None), "admit needs offsets and spare"
    assert spare is None or offsets is not None, "spare needs offsets"
    N, H = x.shape
    I, k = expert_ffn, ids.shape[1]
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    P = N * k
    act = torch.empty((P, I), device=x.device, dtype=x.dtype)
    y = torch.empty((P, H), device=x.device, dtype=x.dtype)  # each pair's weighted expert output
    out = torch.empty_like(x) if out is None else out  # (N, H)
    if P == 0:
        return out.zero_()
    E = pool.shape[0] if offsets is None else offsets.shape[0]
    offs = ids if offsets is None else offsets  # any int64 tensor stands in when unused
    sp = ids if spare is None else spare
    has = dict(HAS_OFFS=offsets is not None, HAS_SPARE=spare is not None, CLAMPED=form is not None, C=CHUNK,
               COPY=COPY_BYTES)
    if form is None:  # any tensors stand in for the biases and the expert ids when unused
        bias_gu = bias_d = experts = ids
        alpha = limit = 0.0
    else:
        bias_gu, bias_d = form.gate_up_bias.contiguous(), form.down_bias.contiguous()
        if bias_gu.shape[1] != 2 * I or bias_d.shape[1] != H or bias_gu.device != x.device:
            raise ValueError(f"expert biases {tuple(bias_gu.shape)}, {tuple(bias_d.shape)} on {bias_gu.device} "
                             f"do not fit experts of ({2 * I}, {H}) on {x.device}")
        experts = (ids if experts is None else experts).contiguous()
        alpha, limit = float(form.alpha), float(form.limit)
    rows_gu, rows_d = (ROWS_INTERPRETED,) * 2 if dequant_gpu.interpreted() else (ROWS_GATE_UP, ROWS_DOWN)
    _gate_up_kernel[(P, triton.cdiv(I, rows_gu))](x, pool, ids, offs, sp, act, experts, bias_gu, alpha, limit, H, I,
                                                  E, k, pool.stride(0), off_g, row_g, off_u, row_u, QG=qg, BG=bg,
                                                  QU=qu, BU=bu, ROWS=rows_gu, num_warps=WARPS, **has)
    _down_kernel[(P, triton.cdiv(H, rows_d))](act, pool, ids, offs, sp, weights, y, experts, bias_d, H, I, E,
                                              pool.stride(0), off_d, row_d, QD=qd, BD=bd, ROWS=rows_d, num_warps=WARPS,
                                              **has)
    return moe_decode_gpu.sum_choices(y, out, ids, sp, offs, admit, cpu)
