"""Per-layer plan: which missed experts fill over PCIe, which run on the CPU, how deep to prefetch.

Cached experts always run on the GPU. The misses are ordered token-heavy first (PDScope's on-demand
monotonicity: if an expert is worth loading, so is every hotter one), then split by policy:

- `adaptive`: the q heaviest fill and the rest run on the CPU, q from the cost model so the GPU side
  (fills + grouped compute) and the CPU side (in place, on the residual DRAM bandwidth) finish
  together (seed 004). In prefill that sends token-heavy experts to the GPU and cold ones to the
  CPU; in decode a fill is taken only while it does not lengthen the layer, so no transfer is made
  that cannot pay back before it is needed. Where every miss could fill instead, the split must also
  win on measured steps: each option's modelled step times what steps of its kind have measured here
  against their model (experts/measured_costs.py), since a split costs more than its CPU compute.
  The link's idle time after the fills (plus the next layer's attention) sets the prefetch depth:
  hidden prefetches always, the partial one by the predictor's confidence in decode and always in
  prefill.
- `on-demand`: every miss fills (Fate style); when a tiny cache cannot hold the layer's misses
  beside its hits, the overflow runs on the CPU.
- `static`, `cpu-only`: misses never fill; they run on the CPU (KTransformers, llama.cpp --cpu-moe).

Pure decision logic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sched.expert_cost import ExpertCostModel

PLANNED_POLICIES = ("adaptive", "on-demand", "static", "cpu-only")


@dataclass
class LayerPlan:
    phase: str  # "prefill" | "decode"
    fill: list[int] = field(default_factory=list)  # expert ids to copy into slots, heaviest first
    cpu: list[int] = field(default_factory=list)  # expert ids to compute on the host
    prefetch: int = 0  # predicted next-layer misses to prefetch
    t_gpu_ms: float = 0.0  # cost-model estimates of the two sides
    t_cpu_ms: float = 0.0


class MissPlanner:
    def __init__(self, policy: str, costs: ExpertCostModel, max_decode_tokens: int):
        if policy not in PLANNED_POLICIES:
            raise ValueError(f"no miss plan for policy '{policy}' (one of {', '.join(PLANNED_POLICIES)})")
        self.policy, self.costs = policy, costs
        self.max_decode_tokens = max(1, int(max_decode_tokens))

    @property
    def fills(self) -> bool:
        return self.policy in ("adaptive", "on-demand")

    @property
    def prefetches(self) -> bool:
        return self.policy == "adaptive"

    def phase(self, n_tokens: int) -> str:
        """Decode steps carry at most max_batch tokens; a larger step is a prefill chunk. (A prefill
        of a few tokens loads experts like a decode step and is planned as one.)"""
        return "prefill" if n_tokens > self.max_decode_tokens else "decode"

    def plan(self, n_tokens: int, misses: list[int], miss_tokens: list[int], n_hits: int, hit_tokens: int,
             capacity: int, predictor_hit_rate: float | None = None,
             step_ratios: tuple[float, float] = (1.0, 1.0)) -> LayerPlan:
        """misses / miss_tokens: missed experts and their routed tokens; capacity: slots fills may
        take without evicting this layer's hits; step_ratios: measured / modelled layer steps with a
        CPU set and without one (MeasuredCosts.step_ratio), 1 where unmeasured."""
        phase = self.phase(n_tokens)
        order = sorted(range(len(misses)), key=lambda i: (-miss_tokens[i], misses[i]))
        ranked = [misses[i] for i in order]
        ranked_tokens = [miss_tokens[i] for i in order]
        capacity = max(0, capacity)
        if self.policy == "adaptive":
            q, t_gpu, t_cpu = self.costs.best_split(ranked_tokens, n_hits, hit_tokens, capacity)
            if q < len(ranked) <= capacity:  # filling every miss is the other choice: compare measured steps
                g_all, _ = self.costs.layer_ms(n_hits, hit_tokens, ranked_tokens, [])
                split_ratio, whole_ratio = step_ratios
                attn = self.costs.attn_ms
                if (g_all + attn) * whole_ratio <= (max(t_gpu, t_cpu) + attn) * split_ratio:
                    q, t_gpu, t_cpu = len(ranked), g_all, 0.0
        else:
            q = min(len(ranked), capacity) if self.policy == "on-demand" else 0
            t_gpu, t_cpu = self.costs.layer_ms(n_hits, hit_tokens, ranked_tokens[:q], ranked_tokens[q:])
        plan = LayerPlan(phase, ranked[:q], ranked[q:], 0, t_gpu, t_cpu)
        if self.prefetches:
            idle = max(t_gpu, t_cpu) - self.costs.fills_ms(q) + self.costs.attn_ms
            rate = 0.5 if predictor_hit_rate is None else predictor_hit_rate
            plan.prefetch = self.costs.prefetch_depth(idle, rate, aggressive=phase == "prefill")
        return plan
