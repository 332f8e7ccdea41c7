"""Skewed routing for synthetic models: router rows rescaled so expert popularity follows Zipf's law.

Synthetic models' routers are random projections: every expert is picked about equally often, the
worst case for any expert cache. Trained routers are skewed. We looked for a published per-layer
expert-reuse or LRU hit-rate figure for Qwen3 or Mixtral routing to match, and found none we could
quote with its number from the paper itself, so this is a documented assumption instead: expert
popularity in each layer follows a Zipf law, p(rank i) ∝ i^(−s), with exponent `s` (default 1.0),
scaled so the k picks of a token add up to k and capped at CAP per expert. Every cell that offloads
experts is reported under both routings, labelled `random` and `zipf-<s>`.

How: a router logit is z_e = w_e · h. With random rows nearly orthogonal and h of unit RMS, the
z_e of a token are close to independent N(0, 1). Scaling row e by s_e widens expert e's logit, so it
lands in the top k more often (at most about half the time: a wide logit is as often very low as
very high — hence the cap). `zipf_scales` finds the scales by a damped fixed-point iteration on
sampled Gaussian logits; `skew_router` applies them to one layer's router (E, H), a fresh random order of
experts per layer (seeded), so no expert id is hot in every layer. The export applies it to the
GGUF both engines then read (`gguf_export.export(..., routing="zipf:1.0")`), so Tandem and
llama.cpp run the same skewed model. This models popularity only, not the step-to-step reuse of a
real trace: an LRU cache sees it as a skewed but independent stream.
"""

from __future__ import annotations

import torch

CAP = 0.45  # most often one expert can be picked by widening its logit (it tends to 0.5)
ROUTINGS = ("random", "zipf")


def parse(routing: str | None) -> float | None:
    """'random' or None → None; 'zipf' → 1.0; 'zipf:1.2' → 1.2."""
    if routing in (None, "", "random"):
        return None
    name, _, value = routing.partition(":")
    if name != "zipf":
        raise ValueError(f"unknown routing '{routing}': use random, zipf or zipf:<exponent>")
    s = float(value) if value else 1.0
    if not 0 < s <= 3:
        raise ValueError(f"zipf exponent {s} out of range (0, 3]")
    return s


def label(routing: str | None) -> str:
    s = parse(routing)
    return "random" if s is None else f"zipf-{s:g}"


def zipf_targets(n_experts: int, top_k: int, s: float) -> torch.Tensor:
    """Pick probabilities per popularity rank: ∝ rank^-s, capped at CAP, summing to top_k."""
    p = torch.arange(1, n_experts + 1, dtype=torch.float64) ** -s
    p = p / p.sum() * top_k
    for _ in range(n_experts):  # water-fill: move the mass above the cap onto the uncapped ranks
        over = p > CAP
        if not over.any():
            break
        excess = (p[over] - CAP).sum()
        p[over] = CAP
        free = ~over & (p < CAP)
        p[free] += excess * p[free] / p[free].sum()
    return p


def pick_rates(scales: torch.Tensor, top_k: int, samples: int = 20_000, seed: int = 0) -> torch.Tensor:
    """How often each expert is in the top k of scaled N(0, 1) logits."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(samples, scales.numel(), generator=g, dtype=torch.float64) * scales
    picks = torch.zeros(scales.numel(), dtype=torch.float64)
    picks.index_add_(0, z.topk(top_k, dim=1).indices.flatten(), torch.ones(samples * top_k, dtype=torch.float64))
    return picks / samples


def zipf_scales(n_experts: int, top_k: int, s: float, iterations: int = 60) -> torch.Tensor:
    """Row scales (by popularity rank) whose pick rates approach zipf_targets.

    A damped step in log scale: every expert's rate depends on all the scales, and a full step
    oscillates (tried); a quarter step settles within ~30 iterations to the sampling noise.
    """
    target = zipf_targets(n_experts, top_k, s).log()
    log_scale = torch.zeros(n_experts, dtype=torch.float64)
    for i in range(iterations):
        rate = pick_rates(log_scale.exp(), top_k, samples=8000, seed=i).clamp_min(1e-4)
        log_scale = (log_scale + 0.25 * (target - rate.log())).clamp(-4.0, 4.0)
        log_scale -= log_scale.median()  # only ratios matter; the median expert keeps scale 1
    return log_scale.exp()


def skew_router(weight: torch.Tensor, s: float, layer: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """One layer's router (E, H) with rows rescaled for Zipf(s) popularity; a per-layer expert order."""
    n = weight.shape[0]
    scales = _cached_scales(n, top_k, s)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + layer))
    per_expert = torch.empty(n, dtype=torch.float64)
    per_expert[order] = scales  # expert order[i] gets popularity rank i
    return (weight.double() * per_expert[:, None]).to(weight.dtype)


_SCALES: dict[tuple, torch.Tensor] = {}


def _cached_scales(n: int, top_k: int, s: float) -> torch.Tensor:
    key = (n, top_k, s)
    if key not in _SCALES:
        _SCALES[key] = zipf_scales(n, top_k, s)
    return _SCALES[key]
