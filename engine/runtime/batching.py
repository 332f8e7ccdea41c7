"""Continuous batching over the Tandem backend: requests join the running batch between decode
steps and leave it the moment they end, up to max_batch at once (the slots of llama-server, the
iteration-level scheduling of vLLM/Orca).

One thread drives a LiveBatch (the server's engine thread): `add` joins a request, `step` runs one
step of the generator's live batch. Both hold the engine's lock, so an Engine.generate call from
elsewhere waits for the step, not for the batch; such a call steps the same live batch (the app's
chats and the server's requests are one batch when they share an engine). Each request has its own
cancel event, checked before every step, and its own callbacks: text as it becomes final, then the
result or the error — an error is that request's alone (Generator: a failing step is re-run one
sequence at a time).
"""

from __future__ import annotations

import threading
from typing import Callable

from engine.errors import ConfigError, TandemError
from engine.runtime.chat import eos_ids
from engine.runtime.generator import SeqRun
from engine.runtime.requests import GenerationRequest, GenerationResult
from engine.runtime.sampling import Sampler
from engine.runtime.textstream import TextStream

OnDone = Callable[[GenerationResult | None, Exception | None], None]


class LiveBatch:
    def __init__(self, backend, lock: threading.Lock, max_batch: int):
        self.backend, self.lock, self.max_batch = backend, lock, max_batch

    @property
    def generator(self):
        return self.backend.generator

    def room(self) -> int:
        """Requests that can join now."""
        return max(0, self.max_batch - len(self.generator.live))

    def busy(self) -> bool:
        return bool(self.generator.live)

    def counters(self) -> dict:
        g = self.generator
        return {"live": len(g.live), "steps": g.steps, "decode_rows": g.decode_rows}

    def add(self, request: GenerationRequest, prompt_ids: list[int], on_text: Callable[[str], None] | None,
            on_done: OnDone, cancel=None) -> None:
        """Join the batch (its prefill runs at the next step). Raises a TandemError, and joins nothing,
        when the request cannot run (bad sampling settings, ids, context); otherwise exactly one
        on_done(result, None) or on_done(None, error) follows, from the thread that steps."""
        if self.room() <= 0:
            raise ConfigError(f"the batch is full ({self.max_batch} sequences)", "wait for one to end")
        b = self.backend
        tok = b.parts.tokenizer
        eos = set() if request.ignore_eos else eos_ids(tok, b.parts.args.eos_token_ids)
        run = SeqRun(list(prompt_ids), request.max_new_tokens, Sampler(request.sampling()), eos,
                     TextStream.for_request(tok, request) if tok is not None else None, on_text, cancel=cancel)
        run.on_done = lambda r: self._done(request, r, on_done)
        with self.lock:
            self.generator.check(run)
            run.session = self.generator.session(request.session_id)
            try:
                self.generator.admit(run)
            except BaseException:
                self._release(request, run)
                raise

    def step(self) -> None:
        with self.lock:
            self.generator.step()

    def _release(self, request: GenerationRequest, run: SeqRun) -> None:
        """A throwaway sequence gives its blocks back; a chat whose reply failed drops its KV (suspect)."""
        if request.session_id is None:
            self.backend.parts.kv.free(run.session.seq_id)
        elif run.finish_reason is None:
            self.generator.end_session(request.session_id)

    def _done(self, request: GenerationRequest, r: SeqRun, on_done: OnDone) -> None:
        from engine.runtime.tandem import compute_failure

        self._release(request, r)
        if r.error is not None:
            error = r.error
            if not isinstance(error, TandemError):
                error = compute_failure(r.error, self.backend.parts.device)
                error.__cause__ = r.error  # the traceback travels with it, for the log
            on_done(None, error)
            return
        on_done(result_of(r), None)


def result_of(r: SeqRun) -> GenerationResult:
    return GenerationResult(text=r.stream.text if r.stream else "", reasoning=r.stream.reasoning if r.stream else "",
                            token_ids=r.generated,
                            finish_reason=r.finish_reason, prompt_tokens=len(r.prompt), prefilled_tokens=r.prefilled,
                            completion_tokens=len(r.generated), ttft_s=r.ttft_s, prefill_tok_s=r.prefill_tok_s,
                            decode_tok_s=r.decode_tok_s)
