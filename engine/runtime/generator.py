"""The prefill/decode loop over a batch of sequences, and chat sessions that keep their KV.

Prefill runs one sequence at a time (T new tokens, chunked), so sequences of different lengths
need no padding there; decode runs every live sequence together, one token each per step. A
session remembers which tokens its KV holds: the next turn crops the KV to the common prefix of
old and new prompt and prefills only the rest.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.errors import ContextOverflowError
from engine.kv.backend import KVBackend
from engine.runtime.sampling import Sampler
from engine.runtime.telemetry import GenerationTimer, Telemetry
from engine.runtime.textstream import TextStream

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds activation memory on long prompts


@dataclass
class Session:
    seq_id: int
    cached: list[int] = field(default_factory=list)  # tokens whose KV is stored, in order


@dataclass
class SeqRun:
    """One sequence inside a generate call."""

    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    eos: set[int]
    stream: TextStream | None = None
    on_text: Callable[[str], None] | None = None
    session: Session | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prefilled: int = 0  # prompt tokens actually computed (the rest came from the session's KV)


class Generator:
    def __init__(self, model, kv: KVBackend, device: torch.device, max_context: int, max_sessions: int,
                 telemetry: Telemetry):
        self.model, self.kv, self.device = model, kv, device
        self.max_context = max_context
        self.max_sessions = max_sessions
        self.telemetry = telemetry
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # LRU: oldest first
        self.graphs = None  # DecodeGraphs where decode steps can be replayed (engine/runtime/decode_graph.py)

    # -- sessions -------------------------------------------------------------------------------
    def session(self, key: str | None) -> Session:
        """The named chat's session (most recently used now), or a throwaway one for key None."""
        if key is not None and key in self.sessions:
            self.sessions.move_to_end(key)
            return self.sessions[key]
        while len(self.sessions) >= self.max_sessions:  # the KV pool holds max_sessions sequences
            _, old = self.sessions.popitem(last=False)
            self.kv.free(old.seq_id)
        s = Session(self.kv.new_sequence())
        if key is not None:
            self.sessions[key] = s
        return s

    def end_session(self, key: str) -> None:
        s = self.sessions.pop(key, None)
        if s is not None:
            self.kv.free(s.seq_id)

    # -- the loop -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, runs: list[SeqRun], stop_event: threading.Event | None = None) -> GenerationTimer:
        timer = GenerationTimer()
        self.telemetry.last = timer
        for r in runs:
            if len(r.prompt) + 1 > self.max_context:
                raise ContextOverflowError(
                    f"the prompt has {len(r.prompt)} tokens; the context window holds {self.max_context}",
                    "shorten the prompt or history, start a new chat, or raise max_context")
        try:
            self.telemetry.phase = "prefill"
            for r in runs:
                if stop_event is not None and stop_event.is_set():
                    r.finish_reason = "stopped"
                    continue
                t0 = time.perf_counter()
                logits = self._prefill(r)
                timer.prefill_tokens += r.prefilled
                timer.prefill_s += time.perf_counter() - t0
                self._accept(r, logits)
                if timer.ttft_s is None:
                    timer.ttft_s = time.perf_counter() - timer.t_start
            self.telemetry.phase = "decode"
            live = [r for r in runs if r.finish_reason is None]
            while live:
                if stop_event is not None and stop_event.is_set():
                    for r in live:
                        r.finish_reason = "stopped"
                    break
                full = [r for r in live if self.kv.length(r.session.seq_id) + 1 > self.max_context]
                for r in full:
                    r.finish_reason = "context_full"
                live = [r for r in live if r.finish_reason is None]
                if not live:
                    break
                t0 = time.perf_counter()
                logits = self._decode_step(live)  # (B, V)
                for r, row in zip(live, logits):
                    self._accept(r, row)
                timer.decode_tokens += len(live)
                timer.decode_s += time.perf_counter() - t0
                live = [r for r in live if r.finish_reason is None]
        finally:
            self.telemetry.phase = "idle"
        for r in runs:
            if r.stream is not None:
                tail = r.stream.finish()
                if tail and r.on_text:
                    r.on_text(tail)
        return timer

    def _prefill(self, r: SeqRun) -> torch.Tensor:
        s = r.session
        common = 0
        for a, b in zip(s.cached, r.prompt):
            if a != b:
                break
            common += 1
        common = min(common, len(r.prompt) - 1)  # at least one token to compute logits from
        self.kv.crop(s.seq_id, common)
        del s.cached[common:]
        logits = None
        for start in range(common, len(r.prompt), PREFILL_CHUNK):
            chunk = r.prompt[start:start + PREFILL_CHUNK]
            logits = self._forward([s], torch.tensor([chunk]))[0]  # (V,)
            s.cached.extend(chunk)
        r.prefilled = len(r.prompt) - common
        return logits

    def _decode_step(self, live: list[SeqRun]) -> torch.Tensor:
        tokens = torch.tensor([[r.generated[-1]] for r in live])  # (B, 1)
        logits = self._forward([r.session for r in live], tokens)
        for r in live:
            r.session.cached.append(r.generated[-1])
        return logits

    def _forward(self, sessions: list[Session], tokens: torch.Tensor) -> torch.Tensor:
        positions = self.kv.begin_step([s.seq_id for s in sessions], tokens.shape[1])  # (B, T)
        try:
            logits = None
            if self.graphs is not None and tokens.shape[1] == 1:
                logits = self.graphs.step(tokens, positions)  # None: this step runs eagerly
            if logits is None:
                logits = self.model(tokens.to(self.device), positions, self.kv)  # (B, V)
        except BaseException:
            self.kv.end_step()  # keep lengths consistent with what was written…
            for s in sessions:  # …then drop this step's tokens again
                self.kv.crop(s.seq_id, len(s.cached))
            raise
        self.kv.end_step()
        return logits

    def _accept(self, r: SeqRun, logits: torch.Tensor) -> None:
        # the whole sequence only where it is read: a 32K prompt's list costs a copy every token
        token = r.sampler(logits, r.prompt + r.generated if r.sampler.uses_history else [])
        r.generated.append(token)
        if r.stream is not None:
            delta = r.stream.add(token) if token not in r.eos else ""
            if delta and r.on_text:
                r.on_text(delta)
            if r.stream.stopped:
                r.finish_reason = "stop"
        if token in r.eos:
            r.finish_reason = "stop"
        elif r.finish_reason is None and len(r.generated) >= r.max_new_tokens:
            r.finish_reason = "length"
