"""The routed FFN of an MoE layer: the router, the family's top-k rule, and the shared experts beside
it. The routed experts themselves live in an expert executor (engine/experts): this module says which
experts a token goes to and with what weight, never where they are placed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ConfigError
from engine.kernels import route_gpu
from engine.kernels.experts_torch import ClampedSwiGLU
from engine.models.common import FeedForward, ModelArgs


class MoEFeedForward(nn.Module):
    """Router + top-k; the routed experts themselves live in an expert executor, not here.

    `route(logits, k, renormalise)` is the family's rule (softmax → top-k → renormalise, …), given the
    config's `norm_topk_prob` (a family whose rule is fixed ignores it); the executor computes
    Σ_k w_k · expert_k(x) wherever the experts are placed. `expert_layer` is the layer's index among the
    MoE layers only (= layer_idx when every layer is MoE): the executor's per-layer lists hold MoE
    layers only.
    """

    def __init__(self, args: ModelArgs, layer_idx: int, route, expert_layer: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.expert_layer = layer_idx if expert_layer is None else expert_layer
        self.top_k = args.top_k
        self.renormalise = args.norm_topk_prob
        self.route = route
        self.gate = nn.Linear(args.dim, args.n_experts, bias=args.router_bias)
        self.route_options = {}  # the family rule's extra settings, when the config has any
        if args.router_score_bias:  # (E,), under the checkpoints' name for it
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(args.n_experts))
        if args.router_score_bias or args.router_groups > 1 or args.routed_scaling != 1.0:
            self.route_options = dict(groups=args.router_groups, groups_used=args.router_groups_used,
                                      scale=args.routed_scaling)
        # Shared experts run for every token: dense weights, on the compute device with the rest.
        self.shared_experts = FeedForward(args.dim, args.shared_expert_ffn_dim) if args.shared_expert_ffn_dim else None
        self.form = None  # experts that are not plain SwiGLU: what the executor is told to compute
        if args.expert_bias or args.expert_act != "silu":
            if args.expert_act != "clamped" or not args.expert_bias:
                raise ValueError(f"no expert FFN of activation {args.expert_act!r} (biases: {args.expert_bias})")
            I = args.expert_ffn_dim
            self.expert_gate_up_bias = nn.Parameter(torch.zeros(args.n_experts, 2 * I))  # (E, 2I) gate half first
            self.expert_down_bias = nn.Parameter(torch.zeros(args.n_experts, args.dim))  # (E, H)
            self.form = (args.expert_alpha, args.expert_limit)
        self.experts = None  # ExpertExecutor, attached by the builder

    @property
    def experts(self):
        return self._experts

    @experts.setter
    def experts(self, executor) -> None:
        """The builder attaches the executor; experts of another form are registered with it, and an
        executor that cannot compute them is refused then, at load, not at the first token."""
        self._experts = executor
        if self.form is None or executor is None or getattr(executor, "stands_in", False):
            return  # plain SwiGLU, or a decode graph's stand-in for the executor already told
        if not hasattr(executor, "set_form"):
            raise ConfigError(f"expert_policy '{executor.policy}' does not compute this model's experts "
                              "(biases, clamped SwiGLU) yet", "use expert_policy resident")
        alpha, limit = self.form
        executor.set_form(self.expert_layer, ClampedSwiGLU(self.expert_gate_up_bias, self.expert_down_bias,
                                                           alpha, limit))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        flat = x.reshape(B * T, H)
        if self.route_options:  # routers choosing by small score differences (groups, biases): fp32, as the reference
            bias = getattr(self.gate, "e_score_correction_bias", None)
            logits = F.linear(flat.float(), self.gate.weight.float())  # (B·T, E)
            weights, ids = self.route(logits, self.top_k, self.renormalise, score_bias=bias, **self.route_options)
        else:
            logits = self.gate(flat)  # (B·T, E)
            weights, ids = self.route(logits, self.top_k, self.renormalise)  # (B·T, k) each
        y = self.experts.run(self.expert_layer, flat, ids, weights.to(x.dtype))  # (B·T, H)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.view(B, T, H)


@dataclass(frozen=True)
class SoftmaxTopK:
    """A family's routing rule: softmax over all experts in fp32 → top-k → the k weights renormalised to
    sum 1 as the config's norm_topk_prob says (`always` None) or whatever it says. A value rather than
    a bare function, so the CPU decode step's native router (engine/runtime/cpu_decode.py) can tell the
    rule and its renormalisation apart from the families' other rules."""

    always: bool | None = None

    def renormalises(self, configured: bool) -> bool:
        return configured if self.always is None else self.always

    def __call__(self, logits: torch.Tensor, k: int, renormalise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(logits, k, self.renormalises(renormalise))


def softmax_topk(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32 over experts, top-k, optional renormalisation (Qwen3-MoE, OLMoE, Mixtral)."""
    if route_gpu.available(logits):  # one kernel on the GPU
        return route_gpu.softmax_topk(logits, k, renormalise)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
