"""A layer's (token, choice) pairs over a pool of expert rows as one grouped computation, on the GPU.

Shared by the cache slots (engine/experts/gpu_set.py) and quantised experts resident on the GPU
(engine/experts/gpu_quant_resident.py): the pairs are sorted by the pool row their expert sits in,
one grouped GEMM pair runs over the pool (engine/kernels/experts_gpu.py), and the weighted rows are
summed back per token. A quantised pool holds blocks, not tensors: `quant_pairs` runs GEMM kernels
that decode the blocks in registers (engine/kernels/quant_moe_gemm_gpu.py).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.kernels import quant_moe_gemm_gpu
from engine.kernels.experts_gpu import grouped_expert_ffn
from engine.kernels.experts_torch import ClampedSwiGLU, moe_experts

log = logging.getLogger("tandem")


def grouped_pairs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, row_of: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, rows: list[int], pairs_per_row: np.ndarray, form=None,
                  group_ends: torch.Tensor | None = None) -> torch.Tensor:
    """x (N, H); ids, weights (N, k); row_of (E,) int64 on x's device: the pool row of each expert, G
    (= gate_up.shape[0]) for experts computed elsewhere; gate_up (G, 2I, H), down (G, H, I); rows: the
    pool rows the pairs use, pairs_per_row their pairs (host-known groups); form: the experts' biases
    and clamped SwiGLU (gpt-oss) or None; group_ends: arange(1, G + 1) on the device where torch's
    grouped GEMM runs (None: the host-known groups' loop) → (N, H) fp32."""
    N, k = ids.shape
    G = gate_up.shape[0]
    row_of_pair = row_of[ids.reshape(-1)]  # (N·k,) pool row, or G for the rest
    sorted_rows, perm = torch.sort(row_of_pair, stable=True)
    xs = x[perm // k]  # (N·k, H) grouped by row
    # The host knows the groups (row order, pairs per row): a pool of more rows than one grouped GEMM
    # takes runs in windows of them without reading the group ends back.
    by_row = np.argsort(rows)
    ends = np.cumsum(pairs_per_row[by_row])
    groups = list(zip(np.asarray(rows)[by_row].tolist(), (ends - pairs_per_row[by_row]).tolist(), ends.tolist()))
    offs = None if group_ends is None else torch.searchsorted(sorted_rows, group_ends, out_int32=True)  # (G,)
    experts = ids.reshape(-1)[perm] if form is not None else None  # (N·k,) the expert of each row: its biases
    y = grouped_expert_ffn(xs, gate_up, down, offs, groups, form=form, rows=experts)  # (N·k, H)
    inside = (sorted_rows < G).unsqueeze(1)  # (N·k, 1)
    w = weights.reshape(-1)[perm].unsqueeze(1).float()
    y = torch.where(inside, y.float() * w, 0.0)  # the other pairs' rows are undefined: zero them
    pairs = torch.empty_like(y).index_copy_(0, perm, y)  # back to (token, choice) order
    return pairs.view(N, k, -1).sum(1)  # (N, H) fp32


def quant_pairs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, layout,
                row_of: torch.Tensor, form=None) -> torch.Tensor:
    """x (N, H); ids, weights (N, k); pool (S, B) uint8: expert blocks laid out by `layout`, a
    QuantLayout; row_of (E,) int64 on x's device: each expert's pool row, one outside [0, S) for the
    experts computed elsewhere (their pairs add nothing) → (N, H) fp32.

    The GEMM kernels over the blocks (engine/kernels/quant_moe_gemm_gpu.py): no dequantised copy, no
    host sync. Where they cannot run (no Triton, or a kernel that does not compile here) the pairs'
    experts are dequantised by torch ops and the reference computes them, slower but the same reply."""
    global _gemm_failed
    if quant_moe_gemm_gpu.available(x) and _gemm_failed is None:
        try:
            return quant_moe_gemm_gpu.moe_prefill_quant(x, ids, weights, pool, layout.kernel_parts, layout.expert_ffn,
                                                        row_of, form)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # a Triton or driver version that cannot build the kernels: say so once, go on
            _gemm_failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            log.warning("quantised experts of many tokens run dequantised by torch ops from now on: the GEMM "
                        "kernels over the blocks failed (%s)", _gemm_failed)
    flat = ids.reshape(-1)
    rows = row_of[flat]  # (N·k,)
    inside = (rows >= 0) & (rows < pool.shape[0])
    used = torch.unique(flat[inside])  # (n,) the experts in the pool (a host sync)
    values = layout.dequantize(pool[row_of[used]]).to(x.dtype)  # (n, 3·I·H)
    H, I = layout.hidden, layout.expert_ffn
    gate_up, down = values[:, :2 * I * H].unflatten(1, (2 * I, H)), values[:, 2 * I * H:].unflatten(1, (H, I))
    place = torch.zeros_like(row_of)
    place[used] = torch.arange(used.numel(), device=x.device)  # expert → its place in `used`
    if form is not None:
        form = ClampedSwiGLU(form.gate_up_bias[used], form.down_bias[used], form.alpha, form.limit)
    w = weights * inside.view_as(weights)  # the pairs computed elsewhere add zero
    return moe_experts(x, place[ids], w, gate_up, down, form).float()


_gemm_failed: str | None = None  # why the GEMM kernels over blocks could not run here, once they failed
