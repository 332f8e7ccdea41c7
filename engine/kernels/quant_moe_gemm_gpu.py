"""Routed experts of many tokens (prefill) straight over GGUF blocks on the GPU: two Triton GEMM kernels.

A prefill chunk routes hundreds of tokens to nearly every expert of a layer, so each expert's weights
serve many rows and the product is a GEMM, not the decode kernels' matrix-vector products
(engine/kernels/quant_moe_gpu.py). The blocks are decoded a tile at a time in registers (dequant_gpu's
`_sub_blocks`: the same fp32 values as gguf, rounded to the activations' dtype) and fed to the tensor
cores, so nothing dequantised is written to memory, no window of experts is staged, and nothing is read
back to the host:

  0. the pairs are grouped by expert on the device (`_align`): each expert's (token, choice) pairs
     padded to whole blocks of BM rows, the expert of each block, the rows in use;
  1. gate_up: program (block of BM rows of one expert, BN rows of I) computes gate and up for its rows
     and writes act = SiLU(gate) · up (or gpt-oss's clamped form) at its padded rows, (M, I);
  2. down: program (block, BN rows of H) writes y[p] = weights[p] · down @ act for each pair p, (P, H)
     fp32; the caller's sum over each token's k choices gives (N, H).

    moe_prefill_quant(x, ids, weights, pool, parts, expert_ffn, row_of) -> (N, H) fp32
        x (N, H) bf16/fp16/fp32; ids (N, k) int64 expert ids; weights (N, k) in x's dtype; pool (S, B)
        uint8, row s one expert's [gate (I, H) | up (I, H) | down (H, I)] blocks, part i of type
        parts[i][0] at byte parts[i][1]; row_of (E,) int64: the pool row of each expert, a row outside
        [0, S) for the experts computed elsewhere (their pairs add zero)

Roundings follow the decode kernels and the grouped GEMM over dequantised tiles: products accumulate
in fp32, gate and up are rounded to x's dtype, SiLU(gate) too, act is stored in it; down's output is
rounded to the dtype, then weighted and summed in fp32. fp32 activations multiply in full fp32
(`input_precision="ieee"`: no TF32), which is what the tests compare against the dequantised experts.
"""

from __future__ import annotations

import torch

from engine.kernels import dequant_gpu
from engine.kernels.quant_moe_gpu import _check

try:
    import triton
    import triton.language as tl

    from engine.kernels.dequant_gpu import _sub_blocks
    from engine.kernels.quant_moe_gpu import _activation
except ImportError:
    triton = None

# A program's tile: BM rows of one expert's pairs (a 512-token chunk of Qwen3-30B-A3B gives an expert
# 32 pairs on average) × BN output rows, SUB sub-blocks of 32 weights a K step. WARPS: Triton's default.
BM, BN, SUB, WARPS = 64, 64, 2, 4
# Triton's interpreter runs programs one after another and pays per operation: taller and wider tiles
# keep the CPU tests fast.
BN_INTERPRETED, SUB_INTERPRETED = 128, 8


def available(x: torch.Tensor) -> bool:
    """Triton importable and x on a CUDA device, or Triton's interpreter (CPU tensors)."""
    return triton is not None and (x.is_cuda or dequant_gpu.interpreted())


if triton is not None:

    @triton.jit
    def _block_rows(pair_ptr, block_expert_ptr, row_of_ptr, top_k, BM: tl.constexpr):
        """Block program_id(0)'s rows → (pair of each row (BM,), rows holding a pair (BM,), token of each
        row (BM,), pool row of the block's expert, the expert)."""
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        pair = tl.load(pair_ptr + m)  # -1: a padding row
        m_ok = pair >= 0
        e = tl.load(block_expert_ptr + tl.program_id(0))
        return pair, m_ok, tl.where(m_ok, pair // top_k, 0), tl.load(row_of_ptr + e), e

    @triton.jit
    def _weight_tile(rows, kb, r_ok, n_sub, l, QT: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr,
                     SUB: tl.constexpr, dtype: tl.constexpr):
        """Sub-blocks kb (BN·SUB,) of the rows whose starts are `rows` (BN·SUB,) → (SUB·32, BN) in dtype:
        a K step of BN rows, transposed for the product."""
        ok_v = r_ok & (kb < n_sub)
        w = _sub_blocks(rows, kb, ok_v, l, ok_v[:, None] & (l[None, :] < 32), QT, BB)  # (BN·SUB, 32) fp32
        return tl.trans(tl.reshape(w, (BN, SUB * 32)).to(dtype))

    @triton.jit
    def _gate_up_gemm(x_ptr, pool_ptr, row_of_ptr, pair_ptr, block_expert_ptr, n_rows_ptr, act_ptr, bias_ptr,
                      alpha, limit, H, I, top_k, stride_slot, off_g, row_g, off_u, row_u, QG: tl.constexpr,
                      BG: tl.constexpr, QU: tl.constexpr, BU: tl.constexpr, CLAMPED: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, SUB: tl.constexpr, IEEE: tl.constexpr):
        if tl.program_id(0) * BM >= tl.load(n_rows_ptr):  # past the padded rows in use
            return
        pair, m_ok, tok, slot, e = _block_rows(pair_ptr, block_expert_ptr, row_of_ptr, top_k, BM)
        dtype = act_ptr.dtype.element_ty
        i = tl.arange(0, BN * SUB)
        r = tl.program_id(1) * BN + i // SUB  # (BN·SUB,) the row of I each sub-block slot belongs to
        s = i % SUB
        r_ok = r < I
        block = pool_ptr + slot * stride_slot
        gate_rows = block + off_g + r.to(tl.int64) * row_g
        up_rows = block + off_u + r.to(tl.int64) * row_u
        l = tl.arange(0, 32)
        kk = tl.arange(0, SUB * 32)
        acc_g = tl.zeros((BM, BN), tl.float32)
        acc_u = tl.zeros((BM, BN), tl.float32)
        n_sub = H // 32
        for k0 in range(0, n_sub, SUB):
            xk = tl.load(x_ptr + tok[:, None] * H + k0 * 32 + kk[None, :],
                         mask=m_ok[:, None] & (k0 * 32 + kk < H)[None, :], other=0.0)  # (BM, SUB·32)
            wg = _weight_tile(gate_rows, k0 + s, r_ok, n_sub, l, QG, BG, BN, SUB, dtype)  # (SUB·32, BN)
            wu = _weight_tile(up_rows, k0 + s, r_ok, n_sub, l, QU, BU, BN, SUB, dtype)
            if IEEE:
                acc_g = tl.dot(xk, wg, acc_g, input_precision="ieee")
                acc_u = tl.dot(xk, wu, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(xk, wg, acc_g)
                acc_u = tl.dot(xk, wu, acc_u)
        n = tl.program_id(1) * BN + tl.arange(0, BN)  # (BN,)
        n_ok = n < I
        if CLAMPED:  # the block's expert's (2I,) gate_up bias
            bias = bias_ptr + e * 2 * I
            gate_bias = tl.load(bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            up_bias = tl.load(bias + I + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        else:
            gate_bias, up_bias = 0.0, 0.0
        act = _activation(acc_g, acc_u, gate_bias, up_bias, alpha, limit, dtype, CLAMPED)  # (BM, BN) fp32
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        tl.store(act_ptr + m.to(tl.int64)[:, None] * I + n[None, :], act.to(dtype), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _down_gemm(act_ptr, pool_ptr, row_of_ptr, pair_ptr, block_expert_ptr, n_rows_ptr, wts_ptr, pairs_ptr, bias_ptr,
                   H, I, top_k, stride_slot, off_d, row_d, QD: tl.constexpr, BD: tl.constexpr,
                   CLAMPED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SUB: tl.constexpr,
                   IEEE: tl.constexpr):
        if tl.program_id(0) * BM >= tl.load(n_rows_ptr):
            return
        pair, m_ok, tok, slot, e = _block_rows(pair_ptr, block_expert_ptr, row_of_ptr, top_k, BM)
        dtype = act_ptr.dtype.element_ty
        i = tl.arange(0, BN * SUB)
        r = tl.program_id(1) * BN + i // SUB  # (BN·SUB,) the output feature each sub-block slot belongs to
        s = i % SUB
        r_ok = r < H
        down_rows = pool_ptr + slot * stride_slot + off_d + r.to(tl.int64) * row_d
        l = tl.arange(0, 32)
        kk = tl.arange(0, SUB * 32)
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        acc = tl.zeros((BM, BN), tl.float32)
        n_sub = I // 32
        for k0 in range(0, n_sub, SUB):
            a = tl.load(act_ptr + m.to(tl.int64)[:, None] * I + k0 * 32 + kk[None, :],
                        mask=m_ok[:, None] & (k0 * 32 + kk < I)[None, :], other=0.0)  # (BM, SUB·32)
            w = _weight_tile(down_rows, k0 + s, r_ok, n_sub, l, QD, BD, BN, SUB, dtype)  # (SUB·32, BN)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = n < H
        if CLAMPED:  # the expert's (H,) down bias, inside F.linear's one rounding
            acc += tl.load(bias_ptr + e * H + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dtype).to(tl.float32)
        w8 = tl.load(wts_ptr + tl.where(m_ok, pair, 0), mask=m_ok, other=0.0).to(tl.float32)  # (BM,)
        tl.store(pairs_ptr + tl.where(m_ok, pair, 0).to(tl.int64)[:, None] * H + n[None, :], y * w8[:, None],
                 mask=m_ok[:, None] & n_ok[None, :])


def _align(ids: torch.Tensor, row_of: torch.Tensor, n_rows: int, bm: int):
    """The pairs grouped by expert, each expert's group padded to whole blocks of bm rows, on the
    device with no host sync → (pair_of (M,) int64: the pair each padded row holds, -1 for padding;
    block_expert (M // bm,) int64: the expert of each block; used (1,) int64: the padded rows in use).
    Pairs whose expert's pool row is outside [0, n_rows) are left out. M bounds the rows in use from
    the shapes alone: P pairs and at most min(E, P) groups of bm − 1 padding rows."""
    E = row_of.shape[0]
    flat = ids.reshape(-1)  # (P,)
    P = flat.shape[0]
    row = row_of[flat]
    key = torch.where((row >= 0) & (row < n_rows), flat, E)  # (P,) the expert, or E: computed elsewhere
    counts = torch.zeros(E + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:E] + bm - 1) // bm * bm  # (E,) rows of each expert's blocks
    ends = torch.cumsum(padded, 0)
    M = -(-(P + min(E, P) * (bm - 1)) // bm) * bm
    starts = torch.cat([ends - padded, ends.new_full((1,), M)])  # (E + 1,): group E lands past M
    first = torch.cumsum(counts, 0) - counts  # (E + 1,) each group's first place in the sorted order
    sorted_key, perm = torch.sort(key, stable=True)  # (P,)
    dest = starts[sorted_key] + torch.arange(P, device=ids.device) - first[sorted_key]  # (P,) padded row
    pair_of = torch.full((M + P,), -1, dtype=torch.int64, device=ids.device)
    pair_of[dest] = perm
    blocks = torch.arange(0, M, bm, device=ids.device)  # (M // bm,) each block's first row
    block_expert = torch.searchsorted(ends, blocks, right=True).clamp_(max=E - 1)
    return pair_of[:M], block_expert, ends[-1:]


def moe_prefill_quant(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, parts,
                      expert_ffn: int, row_of: torch.Tensor, form=None) -> torch.Tensor:
    """See the module's docstring → (N, H) fp32. form: gpt-oss's experts (experts_torch.ClampedSwiGLU,
    its biases (E, 2I) and (E, H) on the device, by expert id) or None for plain SwiGLU."""
    (qg, bg, off_g, row_g), (qu, bu, off_u, row_u), (qd, bd, off_d, row_d) = _check(
        x, ids, weights, pool, parts, expert_ffn, None)
    if row_of.dtype != torch.int64 or row_of.dim() != 1 or row_of.device != x.device:
        raise ValueError(f"row_of must be (E,) int64 on {x.device}; got {tuple(row_of.shape)} {row_of.dtype}")
    N, H = x.shape
    I, k = expert_ffn, ids.shape[1]
    P = N * k
    y = torch.zeros((P, H), dtype=torch.float32, device=x.device)  # the pairs left out stay zero
    if P == 0:
        return y.view(N, k, H).sum(1)
    x, weights = x.contiguous(), weights.contiguous()
    pair_of, block_expert, used = _align(ids, row_of, pool.shape[0], BM)
    act = torch.empty((pair_of.shape[0], I), dtype=x.dtype, device=x.device)  # (M, I) by padded row
    if form is None:  # any tensor stands in for the biases
        bias_gu = bias_d = x
        alpha = limit = 0.0
    else:
        bias_gu, bias_d = form.gate_up_bias.contiguous(), form.down_bias.contiguous()
        if bias_gu.shape != (row_of.shape[0], 2 * I) or bias_d.shape != (row_of.shape[0], H) \
                or bias_gu.device != x.device:
            raise ValueError(f"expert biases {tuple(bias_gu.shape)}, {tuple(bias_d.shape)} on {bias_gu.device} "
                             f"do not fit {row_of.shape[0]} experts of ({2 * I}, {H}) on {x.device}")
        alpha, limit = float(form.alpha), float(form.limit)
    bn, sub = (BN_INTERPRETED, SUB_INTERPRETED) if dequant_gpu.interpreted() else (BN, SUB)
    blocks = pair_of.shape[0] // BM
    flags = dict(CLAMPED=form is not None, BM=BM, BN=bn, SUB=sub, IEEE=x.dtype == torch.float32, num_warps=WARPS)
    _gate_up_gemm[(blocks, triton.cdiv(I, bn))](x, pool, row_of, pair_of, block_expert, used, act, bias_gu, alpha,
                                                limit, H, I, k, pool.stride(0), off_g, row_g, off_u, row_u,
                                                QG=qg, BG=bg, QU=qu, BU=bu, **flags)
    _down_gemm[(blocks, triton.cdiv(H, bn))](act, pool, row_of, pair_of, block_expert, used, weights, y, bias_d, H, I,
                                             k, pool.stride(0), off_d, row_d, QD=qd, BD=bd, **flags)
    return y.view(N, k, H).sum(1)  # (N, H) fp32: each token's k choices in fp32
