"""A layer's CPU set: its operands, and the kernel that computes it.

The driving thread groups the operands (`cpu_set_inputs`) and prepares the call (`prepare`, from
`default_cpu_moe` or `per_expert_moe`); the worker thread only runs the prepared compute. With the
native extension that is one call with the GIL released (experts_cpu.prepare_moe): a worker that runs
Python would contend for the GIL with the driving thread's host work (phases AR–AU in
benchmarks/RESULTS.md).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.experts.store import ExpertStore
from engine.kernels.experts_torch import expert_ffn


def default_cpu_kernel():
    """The native CPU expert kernel where it is built, else torch: (expert_ffn, name)."""
    try:
        from engine.kernels import experts_cpu
    except ImportError:
        return expert_ffn, "torch"
    return experts_cpu.expert_ffn, str(getattr(experts_cpu, "IMPLEMENTATION", "experts_cpu"))


def per_expert_moe(ffn):
    """A layer's CPU set from a per-expert kernel ffn(x (n, H), gate_up, down) → (n, H) (an injected
    kernel, or torch without the experts_cpu module): same contract as experts_cpu.prepare_moe."""
    def prepare(x, experts, tokens, weights, out=None):
        def compute():
            result = torch.zeros(x.shape, dtype=torch.float32) if out is None else out.zero_()  # (N, H)
            for (gate_up, down), tok, w in zip(experts, tokens, weights):
                idx = torch.from_numpy(tok)
                result.index_add_(0, idx, ffn(x[idx], gate_up, down).float() * torch.from_numpy(w).unsqueeze(1))
            return result
        return compute
    return prepare


def default_cpu_moe():
    """A layer's whole CPU set in one call (one fork of the native thread team per layer):
    (prepare(x, experts, tokens, weights, out) → compute(), name)."""
    try:
        from engine.kernels import experts_cpu
    except ImportError:
        return per_expert_moe(expert_ffn), "torch"
    return experts_cpu.prepare_moe, str(getattr(experts_cpu, "IMPLEMENTATION", "experts_cpu"))


def cpu_set_inputs(store: ExpertStore, layer: int, experts: list[int], ids_h: np.ndarray, w_h: torch.Tensor):
    """The CPU set's operands, grouped here so the worker thread spends no Python on them:
    (store views per expert, token rows per expert, fp32 routing weights per expert)."""
    k = ids_h.shape[1]
    flat = ids_h.ravel()
    order = np.argsort(flat, kind="stable")  # (token, choice) pairs grouped by expert
    sorted_ids = flat[order]
    lo = np.searchsorted(sorted_ids, experts, side="left")
    hi = np.searchsorted(sorted_ids, experts, side="right")
    w_flat = w_h.reshape(-1).float().numpy()  # (N·k,)
    pairs = [order[a:b] for a, b in zip(lo.tolist(), hi.tolist())]
    return [store.expert(layer, e) for e in experts], [p // k for p in pairs], [w_flat[p] for p in pairs]
