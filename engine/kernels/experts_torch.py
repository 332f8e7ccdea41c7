"""Routed-expert SwiGLU FFN in plain torch, on whichever device the weights live.

Expert weights use the fused layout of transformers 5.x: gate_up (E, 2·I, H) with the gate rows
first, down (E, H, I). This is the reference implementation; grouped GPU and native CPU kernels
(their own issues) must match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up of a fused product (…, 2·I), gate first → (…, I)."""
    gate, up = gate_up.chunk(2, dim=-1)  # views
    return F.silu(gate) * up


def expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x: (n, H); gate_up: (2·I, H); down: (H, I) → (n, H)."""
    return F.linear(swiglu(F.linear(x, gate_up)), down)


def group_by_expert(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int]]:
    """ids: (N, k) expert of each (token, choice) → flat (token, choice) order sorted by expert, and
    the count per expert (a host list: one device sync per layer)."""
    order = torch.argsort(ids.flatten(), stable=True)  # (N·k,)
    counts = torch.bincount(ids.flatten(), minlength=n_experts).tolist()
    return order, counts


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, form: "ClampedSwiGLU | None" = None) -> torch.Tensor:
    """Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) for every token t.

    x: (N, H); ids, weights: (N, k); gate_up: (E, 2I, H); down: (E, H, I). form: another expert FFN
    (biases, another activation); None: SwiGLU.
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
        y = expert_ffn(x[tok], gate_up[e], down[e]) if form is None else form.ffn(x[tok], e, gate_up[e], down[e])
        y = y * flat_w[start:start + n, None]  # (n, H)
        out.index_add_(0, tok, y)
        start += n
    return out


@dataclass
class ClampedSwiGLU:
    """gpt-oss's expert FFN, for a layer's experts (the engine's gate-first layout):

        g, u = (W_gu x + b_gu).chunk(2)          g, u: (n, I)
        g = min(g, limit); u = clamp(u, ±limit)
        y = W_d ((u + 1) · g · σ(alpha · g)) + b_d

    gate_up_bias (E, 2I) gate half first, down_bias (E, H); on the weights' device.
    """

    gate_up_bias: torch.Tensor
    down_bias: torch.Tensor
    alpha: float = 1.702
    limit: float = 7.0

    def ffn(self, x: torch.Tensor, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """x: (n, H); gate_up: (2I, H); down: (H, I) of `expert` → (n, H)."""
        gate, up = F.linear(x, gate_up, self.gate_up_bias[expert]).chunk(2, dim=-1)  # (n, I) each
        return F.linear(self.activation(gate, up), down, self.down_bias[expert])

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up (n, I), their biases added → the down projection's input (n, I)."""
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)
