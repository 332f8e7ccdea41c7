"""Next-token choice: greedy, or temperature / top-k / top-p with a repetition penalty and a seed.

Limits that keep the arithmetic finite (fp32 logits of magnitude up to ~1e4): a temperature below
MIN_TEMPERATURE is greedy (logits / 1e-38 overflow to inf and the softmax turns NaN; below 1e-3 the
tempered softmax is one-hot to fp32 rounding anyway); a repetition penalty outside
REPETITION_PENALTY_RANGE is refused (× 1e-300 underflows to 0, ÷ 1e-300 overflows); a seed is an
integer in [0, 2^64) (what the generator's seed holds). Should a row's probabilities still be
unusable (the model's logits NaN or all −inf), the draw falls back to the argmax of its finite logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.kernels.cuda_streams import to_device_async

MIN_TEMPERATURE = 1e-3  # below: greedy (one-hot to fp32 rounding anyway; see above)
REPETITION_PENALTY_RANGE = (0.01, 10.0)  # inclusive
SEED_LIMIT = 2**64  # seeds are integers in [0, SEED_LIMIT)


@dataclass
class SamplingParams:
    greedy: bool = False
    temperature: float = 0.7
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off; >1 discourages tokens already in the sequence
    seed: int | None = None

    def problem(self) -> str | None:
        """What is wrong with these settings, or None."""
        lo, hi = REPETITION_PENALTY_RANGE
        if not math.isfinite(self.temperature) or self.temperature < 0:
            return f"temperature {self.temperature}: use a finite value ≥ 0 (below {MIN_TEMPERATURE}: greedy)"
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            return f"top_k {self.top_k}: use an integer ≥ 0 (0: off)"
        if not 0 < self.top_p <= 1:  # NaN fails this too
            return f"top_p {self.top_p}: use 0 < top_p ≤ 1"
        if not lo <= self.repetition_penalty <= hi:
            return f"repetition_penalty {self.repetition_penalty}: use {lo} ≤ repetition_penalty ≤ {hi} (1: off)"
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < SEED_LIMIT):
            return f"seed {self.seed}: use an integer in [0, 2^64)"
        return None

    def validate(self) -> None:
        from engine.errors import ConfigError
        problem = self.problem()
        if problem is not None:
            raise ConfigError(f"invalid sampling settings: {problem}", "change that setting and try again")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature < MIN_TEMPERATURE


class Sampler:
    """One per sequence: owns its random generator so a seed reproduces the same text."""

    def __init__(self, params: SamplingParams):
        params.validate()
        self.p = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    @property
    def uses_history(self) -> bool:
        """Whether a call reads the sequence so far (the caller can skip building it)."""
        return self.p.repetition_penalty != 1.0

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        """logits: (V,) on any device; history: every token of the sequence so far → the chosen id."""
        return int(self.choose(logits, history))

    def choose(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """The chosen id as a 0-d int64 tensor where the logits are, without waiting for it (the decode
        loop reads it a step later). The arithmetic runs where the logits are: copying a 152K
        vocabulary's logits to the host and drawing there costs ~1.3 ms of host time a token (bs=1). The
        caller's tensor is not changed."""
        logits = logits.float()  # (V,)
        V, p = logits.numel(), self.p
        if p.repetition_penalty != 1.0 and history:
            seen = to_device_async(torch.tensor(sorted(set(history)), dtype=torch.int64), logits.device)
            vals = logits[seen]
            logits = logits.index_put((seen,), torch.where(vals > 0, vals / p.repetition_penalty,
                                                            vals * p.repetition_penalty))
        if p.is_greedy:
            return torch.argmax(logits)
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, V)).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))  # no boolean indexing: no sync
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            drop = probs.cumsum(-1) - probs > p.top_p  # keep the first token past top_p
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        # Inverse CDF with one uniform draw: exact, and ~50× faster than torch.multinomial over a
        # 152K vocabulary on the CPU (5 ms a token on the GPU machine). float64: the tail keeps its mass.
        # The draw comes from the sampler's own CPU generator wherever the logits are: a seed gives
        # the same uniforms on every device.
        cdf = torch.cumsum(torch.softmax(logits, dim=-1).double(), dim=0)  # (V,)
        u = to_device_async(torch.rand(1, generator=self.gen, dtype=torch.float64), logits.device) * cdf[-1]
        drawn = torch.searchsorted(cdf, u, right=True).clamp_(max=V - 1)[0]
        # NaN or no mass (the model's logits NaN, or every token masked): the best finite logit instead,
        # chosen on the device (no sync), so a broken row can never repeat the vocabulary's last id
        usable = torch.isfinite(cdf[-1]) & (cdf[-1] > 0)
        return torch.where(usable, drawn, torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))))

