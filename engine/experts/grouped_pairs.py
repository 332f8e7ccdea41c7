"""A layer's (token, choice) pairs over a pool of expert rows as one grouped computation, on the GPU.

Shared by the cache slots (engine/experts/gpu_set.py) and quantised experts resident on the GPU
(engine/experts/gpu_quant_resident.py): the pairs are sorted by the pool row their expert sits in,
one grouped GEMM pair runs over the pool (engine/kernels/experts_gpu.py), and the weighted rows are
summed back per token. A quantised pool holds blocks, not tensors: `QuantTiles` dequantises the rows a
batch uses into tiles of the engine dtype, a window of experts at a time, and runs the same
computation over the tiles, each window over its own rows of the pairs sorted once.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels.experts_gpu import grouped_expert_ffn

# Dequantised tiles of a quantised pool's experts for a batch of many tokens, in bytes: a window of
# experts at a time (Qwen3-30B-A3B bf16: 27 experts of 9.4 MB; gpt-oss-20b: 5 of 50 MB), small beside
# the planner's device reserve (engine/runtime/expert_placement.py RESERVE_BYTES).
TILE_BYTES = 256 << 20


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


class QuantTiles:
    """Tiles (W, 3·I·H) of the engine dtype on the device, for a batch over a quantised pool."""

    def __init__(self, hidden: int, expert_ffn: int, n_experts: int, dtype: torch.dtype, device: torch.device,
                 grouped_mm: bool):
        self.hidden, self.expert_ffn = hidden, expert_ffn
        P = 3 * hidden * expert_ffn
        window = max(1, min(n_experts, TILE_BYTES // (P * torch.empty((), dtype=dtype).element_size())))
        self.tiles = torch.empty((window, P), dtype=dtype, device=device)
        split = 2 * expert_ffn * hidden
        self.gate_up = self.tiles[:, :split].unflatten(1, (2 * expert_ffn, hidden))  # (W, 2I, H)
        self.down = self.tiles[:, split:].unflatten(1, (hidden, expert_ffn))  # (W, H, I)
        self.grouped_mm = grouped_mm  # torch's grouped GEMM runs here (else the host-known groups' loop)

    @property
    def window(self) -> int:
        return self.tiles.shape[0]

    def ffn(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, layout,
            experts: list[int], pool_rows: list[int], pairs_per_expert: np.ndarray, n_experts: int,
            form=None) -> torch.Tensor:
        """The pairs of `experts` (pool_rows: where each one's blocks sit in pool (S, B) uint8, laid out
        by `layout`, a QuantLayout) → (N, H) fp32; the other pairs add nothing.

        The pairs are sorted once, by each one's expert's place in `experts` (the others last), so a
        window's pairs are one contiguous range of rows whose bounds the host knows: each window
        dequantises its experts into the tiles and runs the grouped GEMM over its own rows only."""
        N, k = ids.shape
        n = len(experts)
        if n == 0:
            return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        ends = np.cumsum(pairs_per_expert)  # (n,) end of each expert's rows in the sorted order
        # the experts, their pool rows and their rows' ends reach the device in one copy
        index = torch.from_numpy(np.array([experts, pool_rows, ends], dtype=np.int64).reshape(3, -1)).to(x.device)
        rank = torch.full((n_experts,), n, dtype=torch.int64, device=x.device)  # (E,) place in `experts`, else n
        rank[index[0]] = torch.arange(n, device=x.device)
        flat = ids.reshape(-1)
        _, perm = torch.sort(rank[flat], stable=True)  # (N·k,) pairs by place, tokens in order within one
        M = int(ends[-1])  # the pairs of `experts`: rows 0 … M − 1 of the sorted order
        perm = perm[:M]
        xs = x[perm // k]  # (M, H) grouped by expert
        rows = flat[perm] if form is not None else None  # (M,) each row's expert id: its biases
        ends_dev = index[2].to(torch.int32)  # (n,)
        order = torch.arange(self.window, device=x.device)  # (W,) tile rows
        y = torch.empty((M, self.hidden), dtype=x.dtype, device=x.device)
        for a in range(0, n, self.window):
            b = min(n, a + self.window)
            r0, r1 = int(ends[a] - pairs_per_expert[a]), int(ends[b - 1])
            if r1 == r0:
                continue
            layout.dequantize_into(self.tiles, order[:b - a], pool[index[1, a:b]])  # (b − a, B) gathered blocks
            groups = [(g, int(ends[a + g] - pairs_per_expert[a + g]) - r0, int(ends[a + g]) - r0) for g in range(b - a)]
            offs = ends_dev[a:b] - r0 if self.grouped_mm else None  # (b − a,) int32 group ends
            y[r0:r1] = grouped_expert_ffn(xs[r0:r1], self.gate_up[:b - a], self.down[:b - a], offs, groups, form=form,
                                          rows=None if rows is None else rows[r0:r1])
        w = weights.reshape(-1)[perm].unsqueeze(1).float()  # (M, 1)
        pairs = torch.zeros((N * k, self.hidden), dtype=torch.float32, device=x.device)
        pairs.index_copy_(0, perm, y.float() * w)  # back to (token, choice) order; the other pairs stay 0
        return pairs.view(N, k, -1).sum(1)  # (N, H) fp32
