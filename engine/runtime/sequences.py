"""The sequences the generator drives: a chat's Session (which tokens its KV holds), a SeqRun (one
sequence in the live batch: prompt, sampler, stream, cancel and done hooks, progress and timings),
and the record of a decode step launched but not yet read by the host."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.runtime.sampling import Sampler
from engine.runtime.textstream import TextStream


@dataclass
class Session:
    seq_id: int
    cached: list[int] = field(default_factory=list)  # tokens whose KV is stored, in order


@dataclass(eq=False)  # identity: `r in runs` must never compare prompts field by field
class SeqRun:
    """One sequence in the live batch."""

    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    eos: set[int]
    stream: TextStream | None = None
    on_text: Callable[[str], None] | None = None
    session: Session | None = None
    cancel: object = None  # anything with is_set() (a threading.Event): set → "stopped" before the next step
    on_done: Callable[["SeqRun"], None] | None = None  # once it has left the batch, on the stepping thread
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None  # what failed its step (finish_reason then stays None)
    prefilled: int = 0  # prompt tokens actually computed (the rest came from the session's KV)
    next_pos: int = 0  # prompt tokens whose KV is stored: prefill progress
    prefill_s: float = 0.0
    t_admitted: float = 0.0  # perf_counter seconds
    t_first: float | None = None  # the first token chosen
    t_done: float | None = None

    @property
    def ended(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def decoding(self) -> bool:
        """Past its prefill: its first token is chosen."""
        return bool(self.generated)

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_admitted

    @property
    def prefill_tok_s(self) -> float | None:
        return self.prefilled / self.prefill_s if self.prefilled and self.prefill_s > 0 else None

    @property
    def decode_tok_s(self) -> float | None:
        """This sequence's own rate after its first token (what its reader saw)."""
        if self.t_first is None or self.t_done is None or len(self.generated) < 2 or self.t_done <= self.t_first:
            return None
        return (len(self.generated) - 1) / (self.t_done - self.t_first)


class _AnyOf:
    """is_set() of several stop events (a run's own and its caller's)."""

    def __init__(self, *events):
        self.events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


@dataclass
class _Launched:
    """A decode step whose sampled tokens the host has not read yet."""

    runs: list[SeqRun]  # its sequences, in row order
    tokens: torch.Tensor  # (B, 1) int64 on the device: the tokens sampled from its logits
    host: torch.Tensor  # (B,) int64 on the host: their copy, valid once `ready` has passed
    ready: object  # a CUDA event after that copy (None on the CPU: already there)
