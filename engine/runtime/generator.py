"""The prefill/decode loop over a batch of sequences, and chat sessions that keep their KV.

Prefill runs one sequence at a time (T new tokens, chunked), so sequences of different lengths
need no padding there; decode runs every live sequence together, one token each per step. A
session remembers which tokens its KV holds: the next turn crops the KV to the common prefix of
old and new prompt and prefills only the rest.

Decode runs one step ahead of the host: a step's tokens are sampled on the device and feed the next
step there, which is launched before the host reads them. Reading a step's tokens (a sync), handing
them to the text streams and preparing the next step used to leave the GPU idle between steps:
resident decode of the 16-layer model at 2K ran 651 tok/s this way against 625 at one chat, and
1,642 against 1,409 at four (H200, benchmarks/RESULTS.md, phase CG). Offloaded experts in one graph
gain once the host reads a step's expert log while the next runs (ZeroCopyDecode) and the sampler's
copies do not wait for the GPU: 2K bs=1, 48 layers, 111 tok/s against 101-103 (phase CK). A
sequence that ends on a token the host has not read yet has been fed it once more; that step's KV
entry is cropped away and its sample dropped.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.errors import ContextOverflowError
from engine.kernels.cuda_streams import to_device_async
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


@dataclass
class _Launched:
    """A decode step whose sampled tokens the host has not read yet."""

    runs: list[SeqRun]  # its sequences, in row order
    tokens: torch.Tensor  # (B, 1) int64 on the device: the tokens sampled from its logits
    host: torch.Tensor  # (B,) int64 on the host: their copy, valid once `ready` has passed
    ready: object  # a CUDA event after that copy (None on the CPU: already there)


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
            self._decode([r for r in runs if r.finish_reason is None], timer, stop_event)
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

    def _decode(self, live: list[SeqRun], timer: GenerationTimer, stop_event: threading.Event | None) -> None:
        """Decode steps until every sequence has finished, each step launched before the host reads
        the tokens of the step before (see the module's docstring)."""
        pending: _Launched | None = None
        while live or pending is not None:
            t0 = time.perf_counter()
            stopped = stop_event is not None and stop_event.is_set()
            runs = [] if stopped else [r for r in live if self._can_step(r, pending)]
            logits = None
            if runs:
                if pending is None:  # the first step after prefill: its tokens are on the host
                    tokens = torch.tensor([[r.generated[-1]] for r in runs])  # (B, 1)
                elif runs == pending.runs:
                    tokens = pending.tokens
                else:  # some sequences ended: the rest's rows of the last samples
                    rows = [pending.runs.index(r) for r in runs]
                    tokens = pending.tokens[to_device_async(torch.tensor(rows), pending.tokens.device)]
                logits = self._forward([r.session for r in runs], tokens)  # (B, V), launched
                if pending is None:  # (later steps' tokens join `cached` once the host has read them)
                    for r in runs:
                        r.session.cached.append(r.generated[-1])
            if pending is not None:
                timer.decode_tokens += self._settle(pending, runs)
            if stopped:
                for r in live:
                    if r.finish_reason is None:
                        r.finish_reason = "stopped"
            pending = self._sample(runs, logits) if runs else None
            live = [r for r in live if r.finish_reason is None]
            timer.decode_s += time.perf_counter() - t0

    def _can_step(self, r: SeqRun, pending: _Launched | None) -> bool:
        """Whether r takes part in the next step, counting the token it has in flight: a sequence
        that will have reached its length or the context does not (so those ends waste no step). One
        that cannot step and has no token in flight has ended: its reason is set here, so the loop
        always either launches a step or has one in flight, or ends."""
        if r.finish_reason is not None:
            return False
        in_flight = pending is not None and r in pending.runs
        if len(r.generated) + in_flight >= r.max_new_tokens:
            if not in_flight:
                r.finish_reason = "length"
            return False
        if self.kv.length(r.session.seq_id) + 1 > self.max_context:
            if not in_flight:
                r.finish_reason = "context_full"
            return False
        return True

    def _sample(self, runs: list[SeqRun], logits: torch.Tensor) -> _Launched:
        """Queue each row's sampling where the logits are, and the copy of the chosen ids to the host."""
        tokens = torch.stack([r.sampler.choose(row, r.prompt + r.generated if r.sampler.uses_history else [])
                              for r, row in zip(runs, logits)]).view(-1, 1)  # (B, 1) int64
        if tokens.device.type != "cuda":
            return _Launched(runs, tokens, tokens.view(-1), None)
        host = torch.empty(len(runs), dtype=torch.int64, pin_memory=True)
        host.copy_(tokens.view(-1), non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _Launched(runs, tokens, host, ready)

    def _settle(self, done: _Launched, fed: list[SeqRun]) -> int:
        """Read a step's tokens and accept them. `fed`: the sequences of the step launched since,
        which was fed these tokens: their KV now holds them, unless the token ended the sequence
        (then that entry is cropped away). → tokens accepted."""
        if done.ready is not None:
            done.ready.synchronize()
        accepted = 0
        for r, token in zip(done.runs, done.host.tolist()):
            if r.finish_reason is not None:  # ended on the token this step was fed: its sample is dropped
                continue
            self._accept_token(r, token)
            accepted += 1
            if r in fed:
                if r.finish_reason is None:
                    r.session.cached.append(token)
                else:
                    self.kv.crop(r.session.seq_id, len(r.session.cached))
        return accepted

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
        self._accept_token(r, r.sampler(logits, r.prompt + r.generated if r.sampler.uses_history else []))

    def _accept_token(self, r: SeqRun, token: int) -> None:
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
