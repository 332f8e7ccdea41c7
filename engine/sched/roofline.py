"""The roofline CPU share of the KV cache (seed 000, §5): pure arithmetic, no torch.

Both engines attend over disjoint parts of one layer's placed KV of L tokens at once:

    T_CPU(r) = r·A·L + C_CPU          A: CPU cost per KV token (reads DRAM in place)
    T_GPU(r) = (1 − r)·B·L + C_GPU    B: GPU cost per KV token (PCIe transfer dominated)

and finish together at r(L) = min(1, max(0, B/(A+B) + Δ/((A+B)·L))), Δ = C_GPU − C_CPU   (Eq. 2).

B is fixed by the format (every streamed chunk has the same shape and pin state) and comes from
calibration; A drifts with the working set, so both are tracked online from measured step times
over a sliding window, back-computing the per-token cost with the fixed overheads known. Eviction
batches are routed whole, each to the side that keeps the sequence's running CPU share closest to
the target ("marginal share": the running share follows r(L) batch by batch).

Units: costs in ns per KV token per layer-step; Δ and the fixed overheads in ms per layer-step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

POLICY_SHARES = {"writescope": None, "gpu-centric": 0.0, "cpu-centric": 1.0}  # None: roofline-driven


def target_share(A_ns: float, B_ns: float, delta_ms: float, placed_tokens: int) -> float:
    """Eq. (2): the CPU share that makes both engines finish together over `placed_tokens` tokens."""
    A, B, delta_ns = max(A_ns, 1e-9), max(B_ns, 1e-9), delta_ms * 1e6
    if placed_tokens <= 0:
        return 1.0 if delta_ns > 0 else 0.0 if delta_ns < 0 else B / (A + B)
    r = B / (A + B) + delta_ns / ((A + B) * placed_tokens)
    return min(1.0, max(0.0, r))


class CostTracker:
    """Per-token cost of one engine, back-computed from the last `window` measured layer-steps:
    cost = (Σ time − n · fixed) / Σ tokens, never below `floor_ns`. Until a sample arrives it is
    the initial (calibrated or default) value."""

    def __init__(self, per_token_ns: float, fixed_ms: float, window: int = 256, floor_ns: float = 1e-3):
        self.initial_ns = float(per_token_ns)
        self.fixed_ns = max(0.0, fixed_ms) * 1e6
        self.floor_ns = floor_ns
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._tokens = 0
        self._time_ns = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds < 0:
            return
        if len(self._samples) == self._samples.maxlen:
            old_tokens, old_ns = self._samples[0]
            self._tokens -= old_tokens
            self._time_ns -= old_ns
        self._samples.append((tokens, seconds * 1e9))
        self._tokens += tokens
        self._time_ns += seconds * 1e9

    @property
    def per_token_ns(self) -> float:
        if not self._samples:
            return self.initial_ns
        return max(self.floor_ns, (self._time_ns - len(self._samples) * self.fixed_ns) / self._tokens)

    def reset(self, per_token_ns: float, fixed_ms: float | None = None) -> None:
        """Start again from a calibrated value (a new profile was loaded)."""
        self.initial_ns = float(per_token_ns)
        if fixed_ms is not None:
            self.fixed_ns = max(0.0, fixed_ms) * 1e6
        self._samples.clear()
        self._tokens, self._time_ns = 0, 0.0


@dataclass(frozen=True)
class RooflineParams:
    A_ns_per_token: float  # CPU attention cost per KV token per layer-step
    B_ns_per_token: float  # GPU (H2D + attention) cost per streamed KV token per layer-step
    delta_ms: float  # Δ = C_GPU − C_CPU, fixed overheads per layer-step
    c_cpu_ms: float = 0.05  # C_CPU: thread hand-off and kernel entry per layer-step


class SharePolicy:
    """The CPU share target of one KV policy: roofline-driven (`fixed` None) or a fixed r.

    Both costs are tracked whatever the policy, so the stats show A and B for the fixed-share
    comparison runs too."""

    def __init__(self, name: str, params: RooflineParams, fixed: float | None = None, window: int = 256):
        self.name = name
        self.fixed = fixed
        self.delta_ms = params.delta_ms
        c_gpu_ms = max(0.0, params.c_cpu_ms + params.delta_ms)
        self.A = CostTracker(params.A_ns_per_token, params.c_cpu_ms, window)
        self.B = CostTracker(params.B_ns_per_token, c_gpu_ms, window)

    @classmethod
    def from_name(cls, policy: str, params: RooflineParams, window: int = 256) -> SharePolicy:
        return cls(policy, params, parse_share(policy), window)

    def target(self, placed_tokens: int) -> float:
        if self.fixed is not None:
            return self.fixed
        return target_share(self.A.per_token_ns, self.B.per_token_ns, self.delta_ms, placed_tokens)

    def calibrate(self, params: RooflineParams) -> None:
        """Replace the starting values with a calibration profile's."""
        self.delta_ms = params.delta_ms
        self.A.reset(params.A_ns_per_token, params.c_cpu_ms)
        self.B.reset(params.B_ns_per_token, max(0.0, params.c_cpu_ms + params.delta_ms))


def parse_share(policy: str) -> float | None:
    """'writescope' → None (roofline), 'gpu-centric' → 0, 'cpu-centric' → 1, 'fixed:<r>' → r."""
    if policy.startswith("fixed:"):
        r = float(policy.split(":", 1)[1])
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"a fixed CPU share must lie in [0, 1], got {r}")
        return r
    if policy not in POLICY_SHARES:
        raise ValueError(f"{policy!r} is not a hybrid KV policy")
    return POLICY_SHARES[policy]


def route_to_cpu(cpu_tokens: int, placed_tokens: int, batch_tokens: int, r_target: float) -> bool:
    """Marginal-share routing of one whole eviction batch: True sends it to the CPU (unpinned)
    region, False to the pinned load region — whichever leaves the running share nearer r_target."""
    after = placed_tokens + batch_tokens
    if after <= 0:
        return r_target >= 0.5
    err_cpu = abs((cpu_tokens + batch_tokens) / after - r_target)
    err_gpu = abs(cpu_tokens / after - r_target)
    return err_cpu < err_gpu


def split_run(cpu_tokens: int, placed_tokens: int, n_tokens: int, quantum: int, r_target: float) -> int:
    """Prefill routing: how many of n_tokens new placed tokens go to the CPU region (a multiple of
    `quantum`, the block size, unless all n go) so the running share lands on r_target."""
    want = r_target * (placed_tokens + n_tokens) - cpu_tokens
    n_cpu = int(round(want / quantum)) * quantum
    return min(n_tokens, max(0, n_cpu))
