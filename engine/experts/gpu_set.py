"""A layer's GPU set: the experts in cache slots (hits and this layer's fills), computed on the device.

The driving thread publishes which slot each expert is in (`publish`: a host map, copied to the
device; the CPU set's experts map to a sentinel slot past the pool). The device then computes every
(token, choice) pair whose expert has a slot, in one of two ways:

    a few tokens (moe_decode_gpu,   matrix-vector products over the slots in place, one launch a step
    quant_moe_gpu)                  of the product: a quantised slot's blocks are dequantised in registers
    more tokens, or biased experts  rows sorted by slot, one grouped GEMM over the slot pool
                                    (engine/kernels/experts_gpu.py), summed back per token; over
                                    quantised slots, GEMM kernels that decode the blocks in registers
                                    (engine/kernels/quant_moe_gemm_gpu.py)

Both read only the published map on the device, so a decode graph piece can capture the first (`side`).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.experts.cache import ExpertCache
from engine.experts.grouped_pairs import grouped_pairs, quant_pairs
from engine.kernels import moe_decode_gpu, quant_linear_gpu, quant_moe_gpu
from engine.kernels.experts_gpu import uses_grouped_mm
from engine.kernels.experts_torch import ClampedSwiGLU


class GpuSet:
    def __init__(self, cache: ExpertCache | None, n_slots: int, n_experts: int, device: torch.device,
                 dtype: torch.dtype, layouts: dict | None = None):
        """cache: the slot pool, None without slots (cpu-only: the map then holds the sentinel only).
        layouts: per MoE layer its QuantLayout where the pool holds quantised blocks."""
        self.cache = cache
        self.layouts = layouts or {}
        self.sentinel = n_slots  # slot id of experts the CPU computes: sorts after every real slot
        on_gpu = device.type == "cuda"
        self.map_host = torch.full((n_experts,), n_slots, dtype=torch.int64, pin_memory=on_gpu)  # expert → slot
        self.map_np = self.map_host.numpy()
        self.map_dev = torch.empty_like(self.map_host, device=device) if on_gpu else self.map_host
        grouped_mm = uses_grouped_mm(device, dtype)  # else: a loop over the host-known groups
        self._group_ends = torch.arange(1, n_slots + 1, device=device) if grouped_mm else None  # (S,)
        self.quantised = cache is not None and cache.quantised  # the pool holds GGUF blocks
        # the matrix-vector kernels over a quantised pool run on this device
        self._blocks_in_place = self.quantised and on_gpu and quant_linear_gpu.works(device)

    def publish(self, experts: list[int], slots: list[int], stream=None) -> None:
        """This layer's expert → slot map on the device (the sentinel for the rest), and the compute
        stream after every fill issued so far."""
        self.map_np.fill(self.sentinel)
        self.map_np[experts] = slots
        if self.map_dev is not self.map_host:  # reused after the next layer's host sync: safe
            self.map_dev.copy_(self.map_host, non_blocking=True)
        if self.cache is not None:
            self.cache.wait_copies(stream)

    def in_place_ok(self, x: torch.Tensor) -> bool:
        """Whether the matrix-vector kernels take these tokens over the slots in place (a few, on CUDA)."""
        if self.quantised:
            return self._blocks_in_place and x.shape[0] <= moe_decode_gpu.MAX_TOKENS
        return moe_decode_gpu.available(x)

    def side(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             out: torch.Tensor | None = None, form: ClampedSwiGLU | None = None) -> torch.Tensor | None:
        """The experts the published map puts in slots → (N, H) in x's dtype, by the matrix-vector
        kernels over the slots in place; None without cache slots. Device work only (captured). form:
        gpt-oss's biased experts (quantised slots only)."""
        if self.cache is None:
            return None
        slot_ids = self.map_dev[ids]  # (N, k) slot, or the sentinel (past the pool: skipped) for CPU pairs
        if self.quantised:
            return quant_moe_gpu.moe_decode_quant(x, slot_ids, weights, self.cache.pool,
                                                  self.layouts[layer].kernel_parts, self.cache.expert_ffn, out=out,
                                                  form=form, experts=ids)
        return moe_decode_gpu.moe_decode(x, slot_ids, weights, self.cache.gate_up, self.cache.down, out=out)

    def compute(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: list[int],
                slots: list[int], pairs_per_expert: np.ndarray, form: ClampedSwiGLU | None = None, stream=None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Σ over the experts in `slots` (pairs_per_expert: (token, choice) pairs of each) → (N, H) in
        x's dtype. form: the layer's experts' biases and clamped SwiGLU (gpt-oss), or None for plain SwiGLU."""
        self.publish(experts, slots, stream)
        if self.in_place_ok(x) and (form is None or self.quantised):  # (the BF16 kernels know no form)
            return self.side(layer, x, ids, weights, out=out, form=form)
        if self.quantised:
            y = quant_pairs(x, ids, weights, self.cache.pool, self.layouts[layer], self.map_dev, form)
        else:
            y = grouped_pairs(x, ids, weights, self.map_dev, self.cache.gate_up, self.cache.down, slots,
                              pairs_per_expert, form, self._group_ends)
        return y.to(x.dtype)
