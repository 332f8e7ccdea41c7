"""One engine shared by many HTTP requests: a FIFO in front of it and one thread that drives it.

The Engine serves one caller at a time, so the server's requests wait here. A single worker thread
takes the oldest waiting job plus whatever else is waiting (up to `batch_size`: the engine's
max_batch on the Tandem backend, which decodes a batch together; 1 on llama.cpp, which would run
them one after another anyway) and runs them as one `Engine.generate_batch` call. Text streams
back to each request's asyncio queue through `loop.call_soon_threadsafe`.

Prompts are tokenised on the worker thread (the tokenizer is never used from two threads at once)
and checked against the context window one by one, so one oversize prompt fails alone and never
takes the batch it would have joined down with it.

Cancellation (a client that went away): a waiting job is skipped; a running batch stops at its
next step once every job in it is cancelled. The engine's stop event is batch-wide, so a batch
that still has a live client runs on to its own end and the cancelled job's text is dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from engine.api import Engine, GenerationRequest, GenerationResult
from engine.errors import ConfigError, ContextOverflowError, TandemError

RECENT_JOBS = 16  # finished jobs kept for /v1/tandem/stats


class QueueFullError(TandemError):
    """More requests are waiting than the server accepts."""


@dataclass
class Job:
    """One request on its way through the engine. `events` receives ("text", str),
    then ("done", GenerationResult) or ("error", Exception)."""

    id: int
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    result: GenerationResult | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def _post(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


class _AllCancelled:
    """The stop event the engine sees for one batch: set once every job in it is cancelled
    (the engine only calls is_set())."""

    def __init__(self, jobs: list[Job], closing: threading.Event):
        self.jobs, self.closing = jobs, closing

    def is_set(self) -> bool:
        return self.closing.is_set() or all(j.cancelled.is_set() for j in self.jobs)


class EngineQueue:
    def __init__(self, engine: Engine, max_pending: int = 64, batch_size: int | None = None, gather_s: float = 0.005):
        self.engine = engine
        batches = getattr(engine.backend, "name", "") == "tandem"
        self.batch_size = batch_size or (engine.config.max_batch if batches else 1)
        self.max_pending = max_pending
        self.gather_s = gather_s  # how long a lone job waits for company before it runs alone
        self._pending: deque[Job] = deque()
        self._calls: deque[tuple[object, concurrent.futures.Future]] = deque()  # run between batches
        self._cv = threading.Condition()
        self._ids = itertools.count(1)
        self._closing = threading.Event()
        self.running: list[Job] = []
        self.counters = dict(submitted=0, completed=0, cancelled=0, failed=0, rejected=0, batches=0,
                             completion_tokens=0, prompt_tokens=0)
        self.recent: deque[dict] = deque(maxlen=RECENT_JOBS)
        self._thread = threading.Thread(target=self._work, name="tandem-serve-engine", daemon=True)
        self._thread.start()

    # -- the request side (event-loop thread) -----------------------------------------------------
    def submit(self, request: GenerationRequest) -> Job:
        loop = asyncio.get_running_loop()
        with self._cv:
            if len(self._pending) >= self.max_pending:
                self.counters["rejected"] += 1
                raise QueueFullError(f"{len(self._pending)} requests are already waiting",
                                     "retry later, or start the server with a larger --max-queue")
            job = Job(next(self._ids), request, loop, asyncio.Queue())
            self._pending.append(job)
            self.counters["submitted"] += 1
            self._cv.notify()
        return job

    def call(self, fn) -> concurrent.futures.Future:
        """Run fn(engine) on the worker thread before the next batch (tokenising for a client: the
        tokenizer stays on one thread); await it with asyncio.wrap_future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._closing.is_set():
                future.set_exception(ConfigError("the server is shutting down", "retry once it is back"))
                return future
            self._calls.append((fn, future))
            self._cv.notify()
        return future

    def stats(self) -> dict:
        with self._cv:
            return {"queued": len(self._pending), "running": len(self.running), "batch_size": self.batch_size,
                    "max_queue": self.max_pending, **self.counters, "recent": list(self.recent)}

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the running batch at its next step, fail the waiting jobs, end the thread."""
        self._closing.set()
        with self._cv:
            waiting, self._pending = list(self._pending), deque()
            self._cv.notify_all()
        for job in waiting:
            job._post("error", ConfigError("the server is shutting down", "retry once it is back"))
        self._thread.join(timeout_s)
        for _fn, future in self._calls:
            future.cancel()

    # -- the engine side (worker thread) ----------------------------------------------------------
    def _take_batch(self) -> list[Job]:
        with self._cv:
            while not self._pending and not self._calls and not self._closing.is_set():
                self._cv.wait()
            if self._closing.is_set() or self._calls:
                return []
            if len(self._pending) < self.batch_size and self.gather_s > 0:
                self._cv.wait(self.gather_s)  # requests arriving together are decoded together
            batch = []
            while self._pending and len(batch) < self.batch_size:
                job = self._pending.popleft()
                if job.cancelled.is_set():
                    self._finish(job, "cancelled", None)
                    continue
                batch.append(job)
            self.running = batch
            return batch

    def _work(self) -> None:
        while not self._closing.is_set():
            self._run_calls()
            batch = self._take_batch()
            if not batch:
                continue
            ready = [job for job in batch if self._prepare(job)]
            if ready:
                self._run(ready)
            with self._cv:
                self.running = []

    def _run_calls(self) -> None:
        while True:
            with self._cv:
                if not self._calls:
                    return
                fn, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 — the caller gets it
                    future.set_exception(e)

    def _prepare(self, job: Job) -> bool:
        """Tokenise the job's prompt and check that it fits; a job that cannot run fails here alone."""
        try:
            ids = self.engine.prompt_ids(job.request)
            if not ids:
                raise ConfigError("the prompt is empty", "send at least one token of prompt")
            if len(ids) + 1 > self.engine.max_context:
                raise ContextOverflowError(f"the prompt has {len(ids)} tokens; the context window holds "
                                           f"{self.engine.max_context}", "shorten the prompt or the history")
        except Exception as e:  # noqa: BLE001 — reported to the request, the server carries on
            self._fail(job, e)
            return False
        job.request = replace(job.request, prompt_ids=ids, messages=None, prompt=None)
        return True

    def _run(self, batch: list[Job]) -> None:
        now = time.monotonic()
        for job in batch:
            job.started = now

        def on_text(index: int, text: str) -> None:
            job = batch[index]
            if not job.cancelled.is_set():
                job._post("text", text)

        try:
            results = self.engine.generate_batch([j.request for j in batch], on_text,
                                                 _AllCancelled(batch, self._closing))
        except Exception as e:  # noqa: BLE001
            for job in batch:
                self._fail(job, e)
            return
        with self._cv:
            self.counters["batches"] += 1
        for job, result in zip(batch, results):
            job.result = result
            self._finish(job, "cancelled" if job.cancelled.is_set() else "completed", result)
            job._post("done", result)

    def _fail(self, job: Job, error: Exception) -> None:
        self._finish(job, "failed", None, error)
        job._post("error", error)

    def _finish(self, job: Job, outcome: str, result: GenerationResult | None, error: Exception | None = None) -> None:
        with self._cv:
            self.counters[outcome] += 1
            record = {"id": job.id, "outcome": outcome, "max_new_tokens": job.request.max_new_tokens,
                      "wait_s": round((job.started or time.monotonic()) - job.submitted, 4)}
            if result is not None:
                self.counters["completion_tokens"] += result.completion_tokens
                self.counters["prompt_tokens"] += result.prompt_tokens
                record.update(finish_reason=result.finish_reason, prompt_tokens=result.prompt_tokens,
                              completion_tokens=result.completion_tokens)
            if error is not None:
                record["error"] = getattr(error, "what", None) or f"{type(error).__name__}: {error}"
            self.recent.append(record)
