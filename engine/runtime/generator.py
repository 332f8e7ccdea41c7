"""The prefill/decode loop over a live batch of sequences.

Continuous batching: sequences are admitted at any time and join the batch at the next step; each
step first runs prefill for the sequences that joined (one sequence per forward, T prompt tokens,
chunked; while others decode, at most PREFILL_BUDGET prompt tokens per step, shortest first, so a
long prompt never holds the others' next token for long), then one decode step over every sequence
past its prefill (B sequences, one token each). A sequence that finishes, is cancelled (its own `cancel`, checked before
every step) or fails leaves at once; its `on_done` runs on the thread that stepped. A failure is the
failing sequence's alone: a prefill is one sequence's forward; a batched decode step that raises is
re-run one sequence at a time, and only those that fail alone end with the error (`SeqRun.error`).
`run()` is the one-call form (admit these, step until they end) that Engine.generate_batch uses.

A chat's session remembers which tokens its KV holds (engine/runtime/sessions.py): the next turn
crops the KV to the common prefix of old and new prompt and prefills only the rest.

Decode runs one step ahead of the host: a step's tokens are sampled on the device and feed the next
step there, which is launched before the host reads them. Reading a step's tokens (a sync), handing
them to the text streams and preparing the next step would otherwise leave the GPU idle between
steps: 4% of resident decode's speed at one chat and 14% at four. Offloaded experts in one graph
gain as well, as long as the host reads a step's expert log while the next runs (ZeroCopyDecode) and
the sampler's copies do not wait for the GPU. A sequence that ends on a token the host has not read
yet has been fed it once more; that step's KV entry is cropped away and its sample dropped. A
sequence joining mid-flight feeds its first token from the host, beside the device-side tokens of
the others.
"""

from __future__ import annotations

import logging
import threading
import time
import torch

from engine.errors import ConfigError, ContextOverflowError
from engine.kernels.cuda_streams import to_device_async
from engine.kv.backend import KVBackend
from engine.runtime.sequences import SeqRun, Session, _AnyOf, _Launched
from engine.runtime.sessions import SessionPool
from engine.runtime.telemetry import GenerationTimer, Telemetry

__all__ = ["Generator", "SeqRun", "Session", "PREFILL_CHUNK", "FLASH_PREFILL_CHUNK", "PREFILL_BUDGET", "prefill_chunk"]

log = logging.getLogger("tandem")

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds the (nh, T, S) fp32 scores where attention makes them
# Where no layer's attention makes scores (flash on CUDA), larger forwards pay the host's launches and the
# grouped expert GEMMs' part-filled tiles over fewer tokens: 16 layers of Qwen3-30B-A3B as Q4_K_M on an
# H100 prefilled 2K prompts at 20.7K tok/s in forwards of 512, 43.5K in 2,048; 32K prompts at 17.4K, 29.6K
# (4,096: 43.4K and 32.5K; benchmarks/h200/2026-12-06-flash-chunks-h100). Activations stay small: a forward
# of 2,048 tokens routes 16K pairs, whose expert inputs and gate/up outputs at that width are ~0.12 GB of bf16.
FLASH_PREFILL_CHUNK = 2048
PREFILL_BUDGET = 128  # prompt tokens per step while other sequences decode: how long joining prompts may
# hold up their next token (512 tokens of prefill took ~2 s on the 2-core machine, a dozen decode steps)


def prefill_chunk(args, kv: KVBackend) -> int:
    """Tokens per prefill forward: FLASH_PREFILL_CHUNK where every layer attends (no recurrent layers)
    over a KV that attends without scores (sinks and sliding windows included), else PREFILL_CHUNK."""
    attends = args is not None and args.attention_layers is None
    return FLASH_PREFILL_CHUNK if attends and kv.flash_prefill else PREFILL_CHUNK


class Generator:
    def __init__(self, model, kv: KVBackend, device: torch.device, max_context: int, max_sessions: int,
                 telemetry: Telemetry):
        self.model, self.kv, self.device = model, kv, device
        self.max_context = max_context
        self.telemetry = telemetry
        self.vocab_size = getattr(getattr(model, "args", None), "vocab_size", None)
        self.keeps_recurrent_state = bool(getattr(kv, "recurrent", False))  # hybrid models (kv/recurrent.py)
        self.sessions = SessionPool(max_sessions)  # chats that keep their KV (engine/runtime/sessions.py)
        self.graphs = None  # DecodeGraphs where decode steps can be replayed (engine/runtime/decode_graph.py); CPUDecodeSteps on a CPU
        self.threads = None  # ThreadChooser where the CPU's thread count is measured (engine/runtime/thread_chooser.py)
        self.prefill_chunk = prefill_chunk(getattr(model, "args", None), kv)  # tokens a forward, one sequence alone
        self.live: list[SeqRun] = []  # admitted and not ended, in order of admission
        self._pending: _Launched | None = None
        self.timer: GenerationTimer | None = None  # counts since the batch was last idle
        self.steps = 0  # decode steps run (with their rows: mean batch = decode_rows / steps)
        self.decode_rows = 0

    # -- sessions -------------------------------------------------------------------------------
    def session(self, key: str | None) -> Session:
        """The named chat's session (most recently used now), or a throwaway one for key None. A
        session whose sequence is in the live batch is never the one evicted."""
        return self.sessions.open(self.kv, key, busy={id(r.session) for r in self.live})

    def end_session(self, key: str) -> None:
        s = self.sessions.get(key)
        if s is not None and any(r.session is s for r in self.live):
            raise ConfigError(f"chat {key} is generating", "stop its reply first")
        self.sessions.end(self.kv, key)

    # -- joining ----------------------------------------------------------------------------------
    def check(self, r: SeqRun) -> None:
        """Refuse what cannot run, before it joins (so it fails alone): an empty prompt, one that does
        not fit the context, token ids outside the vocabulary."""
        if not r.prompt:
            raise ConfigError("the prompt is empty", "send at least one token of prompt")
        if len(r.prompt) + 1 > self.max_context:
            raise ContextOverflowError(
                f"the prompt has {len(r.prompt)} tokens; the context window holds {self.max_context}",
                "shorten the prompt or history, start a new chat, or raise max_context")
        lo, hi = min(r.prompt), max(r.prompt)
        if lo < 0 or (self.vocab_size is not None and hi >= self.vocab_size):
            bad = lo if lo < 0 else hi
            raise ConfigError(f"token id {bad} is outside the vocabulary (0 … {(self.vocab_size or 1) - 1})",
                              "send token ids of this model's tokenizer")
        if r.session is not None and any(x.session is r.session for x in self.live):
            raise ConfigError("this chat is already generating", "wait for its reply or stop it")

    def admit(self, r: SeqRun) -> None:
        """r joins the live batch: its prefill runs at the next step. The KV keeps the longest common
        prefix of what the session holds and r's prompt (at least one token is computed, for logits)."""
        self.check(r)
        if r.session is None:
            r.session = self.session(None)
        r.next_pos = self.sessions.resume(self.kv, r.session, r.prompt)
        r.t_admitted = time.perf_counter()
        if not self.live:
            self.timer = GenerationTimer()
            self.telemetry.last = self.timer
        self.live.append(r)

    # -- the loop -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, runs: list[SeqRun], stop_event: threading.Event | None = None) -> GenerationTimer:
        """Admit `runs` and step until each has ended (sequences already live step along); raises the
        first error of one of them, after all have ended. → the call's own counts."""
        for r in runs:
            self.check(r)
        if stop_event is not None:
            for r in runs:
                r.cancel = _AnyOf(r.cancel, stop_event)
        for r in runs:
            self.admit(r)
        busy = self.timer
        before = (busy.decode_tokens, busy.decode_s)
        t0 = time.perf_counter()
        try:
            while any(not r.ended for r in runs):
                self.step()
        except BaseException as e:  # not a step's failure (those end their sequence): leave consistent
            self.abort(e)
            raise
        errors = [r.error for r in runs if r.error is not None]
        if errors:
            raise errors[0]
        timer = GenerationTimer(t_start=t0, prefill_tokens=sum(r.prefilled for r in runs),
                                prefill_s=sum(r.prefill_s for r in runs),
                                decode_tokens=busy.decode_tokens - before[0], decode_s=busy.decode_s - before[1])
        ttfts = [r.ttft_s for r in runs if r.ttft_s is not None]
        timer.ttft_s = min(ttfts) if ttfts else None
        return timer

    @torch.inference_mode()
    def step(self) -> None:
        """One step of the live batch: prefill of sequences that joined (up to PREFILL_CHUNK tokens),
        then one decode step over the rest; then the ended leave."""
        if not self.live:
            return
        try:
            for r in self.live:  # cancelled before their first token: no prefill (decoding ones: in the step)
                if not r.ended and not r.decoding and r.cancel is not None and r.cancel.is_set():
                    r.finish_reason = "stopped"
            self._prefill_some()
            self._decode_step()
        finally:
            self._leave()
            self.telemetry.phase = "decode" if self.live else "idle"

    def abort(self, error: BaseException) -> None:
        """Every live sequence ends with `error` (the loop itself failed)."""
        for r in self.live:
            if not r.ended:
                r.error = error
        self._pending = None
        self._leave()
        self.telemetry.phase = "idle"

    def _prefill_some(self) -> None:
        """Prefill of joined sequences: one alone, whole chunks; beside others (decoding or waiting),
        up to PREFILL_BUDGET tokens a step, shortest remaining prompt first (a one-line question gets
        its first token at the next step even while a long document is being read in)."""
        waiting = [r for r in self.live if not r.ended and not r.decoding]
        if not waiting:
            return
        # Others in the batch (decoding, or waiting to be read too): share the step, shortest prompt first,
        # so a long prompt read whole does not hold up a short question that came beside it.
        shared = any(r.decoding and not r.ended for r in self.live) or len(waiting) > 1
        per_forward = self.prefill_chunk
        timer, budget = self.timer, PREFILL_BUDGET if shared else per_forward
        if shared:
            waiting.sort(key=lambda r: len(r.prompt) - r.next_pos)
        for r in waiting:
            if budget <= 0:
                break
            self.telemetry.phase = "prefill"
            t0, computed = time.perf_counter(), 0
            self.telemetry.prefill_read = (r.next_pos, len(r.prompt))
            try:
                logits = None
                while r.next_pos < len(r.prompt) and budget > 0:
                    size = per_forward if not shared else min(per_forward, budget)
                    left = len(r.prompt) - r.next_pos
                    if self.keeps_recurrent_state and 1 < left <= size:
                        # the prompt's last token in a step of its own, the state before it kept: a
                        # regenerate resumes there (a recurrent state cannot be cropped back)
                        size = left - 1
                    elif self.keeps_recurrent_state and left == 1:
                        self.kv.keep_state(r.session.seq_id)
                    chunk = r.prompt[r.next_pos:r.next_pos + size]
                    logits = self._forward([r.session], torch.tensor([chunk]))[0]  # (V,)
                    r.session.cached.extend(chunk)
                    r.next_pos += len(chunk)
                    computed += len(chunk)
                    budget -= len(chunk)
                    self.telemetry.prefill_read = (r.next_pos, len(r.prompt))  # "reading 12,000 / 32,000"
                if r.next_pos == len(r.prompt):
                    self._accept(r, logits)
                    r.t_first = time.perf_counter()
                    timer.ttft_s = r.ttft_s
            except Exception as e:  # noqa: BLE001 — this sequence's alone
                self._fail(r, e)
            self.telemetry.prefill_read = None
            dt = time.perf_counter() - t0
            r.prefilled += computed
            r.prefill_s += dt
            timer.prefill_tokens += computed
            timer.prefill_s += dt

    def _decode_step(self) -> None:
        """One decode step, launched before the host reads the tokens of the step before (see the
        module's docstring)."""
        pending, timer = self._pending, self.timer
        ready = [r for r in self.live if r.decoding and not r.ended]
        if not ready and pending is None:
            return
        self.telemetry.phase = "decode"
        t0 = time.perf_counter()
        stopped = [r for r in ready if r.cancel is not None and r.cancel.is_set()]
        runs = [r for r in ready if not any(r is x for x in stopped) and self._can_step(r, pending)]
        logits = None
        if runs:
            in_flight = pending.runs if pending is not None else []
            cont = [r for r in runs if r in in_flight]
            new = [r for r in runs if r not in in_flight]  # joined since: their token is on the host
            runs = cont + new
            try:
                logits = self._forward([r.session for r in runs], self._step_tokens(cont, new, pending))  # (B, V)
            except Exception as e:  # noqa: BLE001 — find whose it is
                self._isolate(runs, e)
                self._stop(stopped)
                timer.decode_s += time.perf_counter() - t0
                return
            for r in new:  # (the others' tokens join `cached` once the host has read them)
                r.session.cached.append(r.generated[-1])
        if pending is not None:
            timer.decode_tokens += self._settle(pending, runs)
        self._stop(stopped)
        self._pending = self._sample(runs, logits) if runs else None
        timer.decode_s += time.perf_counter() - t0

    def _step_tokens(self, cont: list[SeqRun], new: list[SeqRun], pending: _Launched | None) -> torch.Tensor:
        """(B, 1) input tokens: continuing sequences' rows of the last samples (on the device), then
        the joined ones' first tokens (from the host)."""
        parts = []
        if cont:
            if cont == pending.runs:
                parts.append(pending.tokens)
            else:  # some sequences ended or left
                rows = torch.tensor([pending.runs.index(r) for r in cont])
                parts.append(pending.tokens[to_device_async(rows, pending.tokens.device)])
        if new:
            host = torch.tensor([[r.generated[-1]] for r in new])  # (n, 1)
            parts.append(to_device_async(host, parts[0].device) if parts else host)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _isolate(self, runs: list[SeqRun], error: Exception) -> None:
        """A batched decode step raised: read the step in flight, then run each sequence's step alone;
        only those that fail alone end with their error, the others go on."""
        if self._pending is not None:
            self.timer.decode_tokens += self._settle(self._pending, [])  # KV now equals `cached` for all
        self._pending = None
        if len(runs) == 1:
            self._fail(runs[0], error)
            return
        log.warning("a decode step of %d sequences failed (%s: %s); running each alone to find whose",
                    len(runs), type(error).__name__, error)
        kept, rows = [], []
        for r in runs:
            if r.ended or not self._can_step(r, None):
                continue
            try:
                rows.append(self._forward([r.session], torch.tensor([[r.generated[-1]]])))  # (1, V)
            except Exception as e:  # noqa: BLE001
                self._fail(r, e)
                continue
            r.session.cached.append(r.generated[-1])
            kept.append(r)
        self._pending = self._sample(kept, torch.cat(rows)) if kept else None

    def _stop(self, stopped: list[SeqRun]) -> None:
        for r in stopped:
            if not r.ended:
                r.finish_reason = "stopped"

    def _fail(self, r: SeqRun, error: BaseException) -> None:
        r.error = error  # its step's KV is already dropped (_forward); its session is the caller's to end

    def _leave(self) -> None:
        if not any(r.ended for r in self.live):
            return
        done = [r for r in self.live if r.ended]
        self.live = [r for r in self.live if not r.ended]
        if not self.live:  # the step in flight is only ended sequences' now: its samples are dropped
            self._pending = None
        now = time.perf_counter()
        for r in done:
            r.t_done = now
            if r.stream is not None and r.error is None:
                for piece in r.stream.finish():
                    if r.on_text:
                        r.on_text(piece)
            if r.on_done is not None:
                try:
                    r.on_done(r)
                except Exception:  # a caller's callback must not take the batch down
                    log.exception("a sequence's on_done callback failed")

    def _can_step(self, r: SeqRun, pending: _Launched | None) -> bool:
        """Whether r takes part in the next step, counting the token it has in flight: a sequence
        that will have reached its length or the context does not (so those ends waste no step). One
        that cannot step and has no token in flight has ended: its reason is set here, so the loop
        always either launches a step or has one in flight, or ends."""
        if r.ended:
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

    def _sample(self, runs: list[SeqRun], logits: torch.Tensor) -> _Launched | None:
        """Queue each row's sampling where the logits are, and the copy of the chosen ids to the host."""
        kept, chosen = [], []
        for r, row in zip(runs, logits):
            try:
                chosen.append(r.sampler.choose(row, r.prompt + r.generated if r.sampler.uses_history else []))
                kept.append(r)
            except Exception as e:  # noqa: BLE001 — this row's alone
                self._fail(r, e)
        if not kept:
            return None
        self.steps += 1
        self.decode_rows += len(kept)
        tokens = torch.stack(chosen).view(-1, 1)  # (B, 1) int64
        if tokens.device.type != "cuda":
            return _Launched(kept, tokens, tokens.view(-1), None)
        host = torch.empty(len(kept), dtype=torch.int64, pin_memory=True)
        host.copy_(tokens.view(-1), non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _Launched(kept, tokens, host, ready)

    def _settle(self, done: _Launched, fed: list[SeqRun]) -> int:
        """Read a step's tokens and accept them. `fed`: the sequences of the step launched since,
        which was fed these tokens: their KV now holds them, unless the token ended the sequence
        (then that entry is cropped away). → tokens accepted."""
        if done.ready is not None:
            done.ready.synchronize()
        accepted = 0
        for r, token in zip(done.runs, done.host.tolist()):
            if r.ended:  # ended on the token this step was fed, or left: its sample is dropped
                continue
            self._accept_token(r, token)
            accepted += 1
            if r in fed:
                if not r.ended:
                    r.session.cached.append(token)
                else:
                    self.kv.crop(r.session.seq_id, len(r.session.cached))
        return accepted

    def _forward(self, sessions: list[Session], tokens: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
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
        if self.threads is not None and tokens.shape[1] == 1:  # (a CPU step: done when the forward returns)
            self.threads.step(time.perf_counter() - started, tokens.shape[0])
        return logits

    def _accept(self, r: SeqRun, logits: torch.Tensor) -> None:
        # the whole sequence only where it is read: a 32K prompt's list costs a copy every token
        self._accept_token(r, r.sampler(logits, r.prompt + r.generated if r.sampler.uses_history else []))

    def _accept_token(self, r: SeqRun, token: int) -> None:
        r.generated.append(token)
        if r.stream is not None:
            for piece in r.stream.add(token) if token not in r.eos else ():
                if r.on_text:
                    r.on_text(piece)
            if r.stream.stopped:
                r.finish_reason = "stop"
        if token in r.eos:
            r.finish_reason = "stop"
        elif r.finish_reason is None and len(r.generated) >= r.max_new_tokens:
            r.finish_reason = "length"
