"""Routed-expert SwiGLU FFN in plain torch, on whichever device the weights live.

Expert weights use the fused layout of transformers 5.x: gate_up (E, 2·I, H) with the gate rows
first, down (E, H, I). This is the reference implementation; grouped GPU and native CPU kernels
(their own issues) must match it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x: (n, H); gate_up: (2·I, H); down: (H, I) → (n, H)."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # (n, I) each
    return F.linear(F.silu(gate) * up, down)


def group_by_expert(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int]]:
    """ids: (N, k) expert of each (token, choice) → flat (token, choice) order sorted by expert, and
    the count per expert (a host list: one device sync per layer)."""
    order = torch.argsort(ids.flatten(), stable=True)  # (N·k,)
    counts = torch.bincount(ids.flatten(), minlength=n_experts).tolist()
    return order, counts


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) for every token t.

    x: (N, H); ids, weights: (N, k); gate_up: (E, 2I, H); down: (E, H, I).
    """
    N, k = ids.shape
    order, counts = group_by_expert(ids, gate_up.shape[0])
    tokens = order // k  # (N·k,) token of each sorted (token, choice)
    flat_w = weights.flatten()[order]  # (N·k,)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = tokens[start:start + n]
        y = expert_ffn(x[tok], gate_up[e], down[e]) * flat_w[start:start + n, None]  # (n, H)
        out.index_add_(0, tok, y)
        start += n
    return out
