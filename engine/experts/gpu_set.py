"""A layer's GPU set: the experts in cache slots (hits and this layer's fills), computed on the device.

The driving thread publishes which slot each expert is in (`publish`: a host map, copied to the
device; the CPU set's experts map to a sentinel slot past the pool). The device then computes every
(token, choice) pair whose expert has a slot, in one of two ways:

    a few tokens (moe_decode_gpu)   matrix-vector products over the slots in place, one launch
    more tokens, or biased experts  rows sorted by slot, one grouped GEMM over the slot pool
                                    (engine/kernels/experts_gpu.py), summed back per token

Both read only the published map on the device, so a decode graph piece can capture them (`side`).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.experts.cache import ExpertCache
from engine.kernels import moe_decode_gpu
from engine.kernels.experts_gpu import grouped_expert_ffn, uses_grouped_mm
from engine.kernels.experts_torch import ClampedSwiGLU


class GpuSet:
    def __init__(self, cache: ExpertCache | None, n_slots: int, n_experts: int, device: torch.device,
                 dtype: torch.dtype):
        """cache: the slot pool, None without slots (cpu-only: the map then holds the sentinel only)."""
        self.cache = cache
        self.sentinel = n_slots  # slot id of experts the CPU computes: sorts after every real slot
        on_gpu = device.type == "cuda"
        self.map_host = torch.full((n_experts,), n_slots, dtype=torch.int64, pin_memory=on_gpu)  # expert → slot
        self.map_np = self.map_host.numpy()
        self.map_dev = torch.empty_like(self.map_host, device=device) if on_gpu else self.map_host
        self._group_ends = torch.arange(1, n_slots + 1, device=device)  # searchsorted → group end rows
        self._grouped_mm = uses_grouped_mm(device, dtype)  # else: a loop over the host-known groups

    def publish(self, experts: list[int], slots: list[int], stream=None) -> None:
        """This layer's expert → slot map on the device (the sentinel for the rest), and the compute
        stream after every fill issued so far."""
        self.map_np.fill(self.sentinel)
        self.map_np[experts] = slots
        if self.map_dev is not self.map_host:  # reused after the next layer's host sync: safe
            self.map_dev.copy_(self.map_host, non_blocking=True)
        if self.cache is not None:
            self.cache.wait_copies(stream)

    def side(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """The experts the published map puts in slots → (N, H) in x's dtype; None without cache
        slots. Device work only (captured)."""
        if self.cache is None:
            return None
        slot_ids = self.map_dev[ids]  # (N, k) slot, or the sentinel (skipped) for CPU pairs
        return moe_decode_gpu.moe_decode(x, slot_ids, weights, self.cache.gate_up, self.cache.down)

    def compute(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: list[int],
                slots: list[int], pairs_per_expert: np.ndarray, form: ClampedSwiGLU | None = None, stream=None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Σ over the experts in `slots` (pairs_per_expert: (token, choice) pairs of each), as one
        grouped computation over the slot pool → (N, H) in x's dtype. form: the layer's experts'
        biases and clamped SwiGLU (gpt-oss), or None for plain SwiGLU."""
        N, k = ids.shape
        self.publish(experts, slots, stream)
        if form is None and moe_decode_gpu.available(x):  # a few tokens: matrix-vector products over the slots in place
            slot_ids = self.map_dev[ids]  # (N, k) slot, or the sentinel (past the pool: skipped) for CPU pairs
            return moe_decode_gpu.moe_decode(x, slot_ids, weights, self.cache.gate_up, self.cache.down, out=out)
        slot_of_pair = self.map_dev[ids.reshape(-1)]  # (N·k,) slot, or the sentinel for CPU pairs
        sorted_slots, perm = torch.sort(slot_of_pair, stable=True)
        xs = x[perm // k]  # (N·k, H) rows grouped by slot
        # The host knows the groups (slot order, rows per slot): a pool of more slots than one grouped
        # GEMM takes runs in windows of them without reading the group ends back.
        by_slot = np.argsort(slots)
        ends = np.cumsum(pairs_per_expert[by_slot])
        groups = list(zip(np.asarray(slots)[by_slot].tolist(), (ends - pairs_per_expert[by_slot]).tolist(),
                          ends.tolist()))
        offs = torch.searchsorted(sorted_slots, self._group_ends, out_int32=True) if self._grouped_mm else None  # (S,)
        rows = ids.reshape(-1)[perm] if form is not None else None  # (N·k,) the expert of each row: its biases
        y = grouped_expert_ffn(xs, self.cache.gate_up, self.cache.down, offs, groups, form=form, rows=rows)  # (N·k, H)
        on_gpu = (sorted_slots < self.sentinel).unsqueeze(1)  # (N·k, 1)
        w = weights.reshape(-1)[perm].unsqueeze(1).float()
        y = torch.where(on_gpu, y.float() * w, 0.0)  # CPU pairs' rows are undefined: zero them
        pairs = torch.empty_like(y).index_copy_(0, perm, y)  # back to (token, choice) order
        return pairs.view(N, k, -1).sum(1).to(x.dtype)  # (N, H)
