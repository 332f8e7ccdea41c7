"""The expert-execution interface between MoE layers and expert placement.

A MoE layer routes (router logits → top-k ids and weights) and hands the tokens to an
ExpertExecutor, which computes Σ_k w_k · expert_k(x) wherever each expert is placed. The result
must not depend on placement. `ResidentExperts` keeps every expert on the compute device; the
offloading executor (host store + GPU LRU cache + planner) implements the same `run`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.kernels import moe_decode_gpu
from engine.kernels.experts_gpu import MAX_GROUPS, moe_experts_grouped, uses_grouped_mm
from engine.kernels.experts_torch import ClampedSwiGLU, moe_experts


class ExpertExecutor(ABC):
    policy: str = "?"

    @abstractmethod
    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: (N, H); ids: (N, k) int64; weights: (N, k) in x's dtype → (N, H)."""

    @abstractmethod
    def telemetry(self) -> dict:
        """Counters for StatsSnapshot's `experts` section (None where they do not apply)."""

    def block_types(self) -> list[str]:
        """The GGUF block types the experts are held in (none: tensors)."""
        return []

    # -- decode graphs ----------------------------------------------------------------------------
    # engine/runtime/decode_graph.py captures decode steps and replays them through these hooks,
    # knowing nothing of where the experts are. The defaults: an executor that cannot be captured.
    cut_at_layers = False  # True: the step is captured in pieces, the host running each MoE layer between them

    def capture_problem(self, device: torch.device, max_batch: int) -> str | None:
        """Why decode steps of up to max_batch tokens cannot be captured as CUDA graphs here, or None."""
        return f"the {self.policy} expert policy cannot be captured"

    def graph_form(self, B: int) -> str:
        """The captured form a decode step of B tokens replays: "graph" (one graph), "pieces" (cut at
        the MoE layers), or another whole-step form of the executor's own."""
        return "pieces" if self.cut_at_layers else "graph"

    def stand_in(self, form: str) -> ExpertExecutor | None:
        """What runs the MoE layers while a step of `form` is warmed up and captured; None: the
        executor itself (cut executors: the runtime's cut at each layer)."""
        return None

    def before_replay(self, B: int, form: str) -> None:
        """Host work before a captured step of B tokens replays."""

    def after_replay(self, B: int, form: str, pairs: int) -> None:
        """Host work after it; pairs: the (token, expert) pairs the step routed."""


# Tokens per layer call up to which the grouped GEMM path runs: every decode batch (one token per
# chat), while prefill chunks, where the per-expert loop is twice as fast, stay above it.
GROUPED_MAX_TOKENS = 64


class ResidentExperts(ExpertExecutor):
    """Every expert of every layer on the compute device, in the fused (E, 2I, H)/(E, H, I) layout."""

    policy = "resident"

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor]):
        self.gate_up, self.down = gate_up, down  # per layer: (E, 2I, H), (E, H, I)
        self.tokens_routed = 0
        self.forms: dict[int, ClampedSwiGLU] = {}  # layers whose experts are not plain SwiGLU (gpt-oss)

    def set_form(self, layer: int, form: ClampedSwiGLU) -> None:
        """The layer's experts compute `form` (biases, clamped activation): the grouped GEMM path
        (decode-sized batches, capturable) and the per-expert torch loop run it; the matrix-vector
        decode kernel knows only plain SwiGLU."""
        self.forms[layer] = form

    def run(self, layer, x, ids, weights):
        self.tokens_routed += ids.numel()
        gate_up, down = self.gate_up[layer], self.down[layer]
        form = self.forms.get(layer)
        if form is not None:
            if x.shape[0] <= GROUPED_MAX_TOKENS and uses_grouped_mm(x.device, x.dtype):
                return moe_experts_grouped(x, ids, weights, gate_up, down, form=form)
            return moe_experts(x, ids, weights, gate_up, down, form)
        if moe_decode_gpu.available(x):  # a few tokens: matrix-vector products over the chosen experts in place
            return moe_decode_gpu.moe_decode(x, ids, weights, gate_up, down)
        # Decode-sized batches: one grouped GEMM pair, no per-expert launch or host sync. Prefill keeps
        # the per-expert loop, which prefills 8K tokens twice as fast on an H200.
        if (x.shape[0] <= GROUPED_MAX_TOKENS and gate_up.shape[0] <= MAX_GROUPS
                and uses_grouped_mm(x.device, x.dtype)):
            return moe_experts_grouped(x, ids, weights, gate_up, down)
        return moe_experts(x, ids, weights, gate_up=gate_up, down=down)

    def capture_problem(self, device: torch.device, max_batch: int) -> str | None:
        if max_batch > GROUPED_MAX_TOKENS:
            return f"max_batch above {GROUPED_MAX_TOKENS} takes the per-expert path, which syncs with the host"
        if self.gate_up:
            dtype = self.gate_up[0].dtype
            if self.gate_up[0].shape[0] > MAX_GROUPS or not uses_grouped_mm(device, dtype):
                return "the grouped expert GEMM does not run here"
        return None

    def after_replay(self, B: int, form: str, pairs: int) -> None:
        self.tokens_routed += pairs  # the counter `run` would have bumped

    def nbytes(self) -> int:
        # Views that share storage (identical upcycled experts on the host) count once.
        seen, total = set(), 0
        for t in (*self.gate_up, *self.down):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    def telemetry(self) -> dict:
        tel = {"policy": self.policy, "bytes": self.nbytes()}
        if self.forms:
            tel["kernel"] = "grouped GEMM or torch loop (expert biases, clamped SwiGLU)"
        return tel
