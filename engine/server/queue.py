"""One engine shared by many HTTP requests: a FIFO in front of it and one thread that drives it.

On the Tandem backend the thread drives a continuous batch (engine/runtime/batching.py): between
two decode steps it admits waiting requests while the batch has room (`batch_size`, the engine's
max_batch), so a request joins the running batch at the next step, and one that ends leaves at
once, making room. Backends that decode one request at a time (llama.cpp, remote) run the oldest
waiting request alone. Text streams back to each request's asyncio queue through
`loop.call_soon_threadsafe`.

Prompts are tokenised on the worker thread (the tokenizer is never used from two threads at once)
and checked one by one before they join, so a request that cannot run fails alone; a step that
fails inside the batch fails only the sequence that caused it (the generator re-runs the step one
sequence at a time), and the failure is logged with its traceback.

Cancellation: a waiting job is skipped; a running one stops at its next step (each job has its
own stop event, set when its client disconnects). Each job also has a wall-clock limit from the
moment it starts: past it the job stops, and its reply ends with what it has (finish "time_limit").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

from engine.api import Engine, GenerationRequest, GenerationResult
from engine.errors import ConfigError, ContextOverflowError, TandemError

log = logging.getLogger("tandem.server")

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
    deadline: float | None = None  # monotonic seconds: the wall-clock limit, once started
    timed_out: bool = False
    result: GenerationResult | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def _post(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


class _JobStop:
    """The stop event the engine checks for one job before every step: its client left, its time
    is up, or the server is closing (the engine only calls is_set())."""

    def __init__(self, job: Job, closing: threading.Event):
        self.job, self.closing = job, closing

    def is_set(self) -> bool:
        job = self.job
        if job.cancelled.is_set() or self.closing.is_set():
            return True
        if job.deadline is not None and time.monotonic() > job.deadline:
            job.timed_out = True
            return True
        return False


class EngineQueue:
    def __init__(self, engine: Engine, max_pending: int = 64, batch_size: int | None = None,
                 time_limit_s: float | None = None):
        self.engine = engine
        self.live = engine.live_batch()  # None: this backend runs one request at a time
        self.batch_size = batch_size or (engine.config.max_batch if self.live is not None else 1)
        if self.live is not None:
            self.live.max_batch = min(self.batch_size, engine.config.max_batch)
        self.max_pending = max_pending
        self.time_limit_s = time_limit_s or None  # per job, from its start; None: no limit
        self._pending: deque[Job] = deque()
        self._calls: deque[tuple[object, concurrent.futures.Future]] = deque()  # run between steps
        self._cv = threading.Condition()
        self._ids = itertools.count(1)
        self._closing = threading.Event()
        self.running: list[Job] = []
        self.counters = dict(submitted=0, completed=0, cancelled=0, timed_out=0, failed=0, rejected=0,
                             batches=0, peak_batch=0, completion_tokens=0, prompt_tokens=0)
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
        """Run fn(engine) on the worker thread before the next step (tokenising for a client: the
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
            engine = self.live.counters() if self.live is not None else {}
            steps = engine.get("steps")
            return {"queued": len(self._pending), "running": len(self.running), "batch_size": self.batch_size,
                    "max_queue": self.max_pending, "time_limit_s": self.time_limit_s, **self.counters,
                    "steps": steps, "mean_batch": round(engine["decode_rows"] / steps, 3) if steps else None,
                    "recent": list(self.recent)}

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the running jobs at their next step, fail the waiting ones, end the thread."""
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
    def _work(self) -> None:
        while not self._closing.is_set():
            self._run_calls()
            if self.live is None:
                job = self._next_job(wait=True)
                if job is not None:
                    self._run_alone(job)
                continue
            self._admit()
            if self.live.busy():
                try:
                    self.live.step()
                except Exception:  # noqa: BLE001 — the generator ended every live job with this error
                    log.exception("a batch step failed outside any one sequence")
            else:
                with self._cv:
                    while not self._pending and not self._calls and not self._closing.is_set():
                        self._cv.wait()
        if self.live is not None:  # closing: the running jobs see their stop events set and leave
            while self.live.busy():
                self.live.step()

    def _next_job(self, wait: bool) -> Job | None:
        """The oldest waiting job that is still wanted (cancelled ones are dropped here)."""
        with self._cv:
            while True:
                while wait and not self._pending and not self._calls and not self._closing.is_set():
                    self._cv.wait()
                if not self._pending or self._closing.is_set():
                    return None
                job = self._pending.popleft()
                if not job.cancelled.is_set():
                    return job
                self._finish(job, "cancelled", None)

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

    def _start(self, job: Job) -> bool:
        """Tokenise the job's prompt and check that it fits; a job that cannot run fails here alone."""
        job.started = time.monotonic()
        if self.time_limit_s:
            job.deadline = job.started + self.time_limit_s
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

    def _on_text(self, job: Job):
        def on_text(text: str) -> None:
            if not job.cancelled.is_set():
                job._post("text", text)
        return on_text

    def _admit(self) -> None:
        """Waiting jobs join the batch while it has room."""
        while self.live.room() > 0:
            job = self._next_job(wait=False)
            if job is None:
                return
            if not self._start(job):
                continue
            try:
                self.live.add(job.request, job.request.prompt_ids, self._on_text(job),
                              lambda result, error, job=job: self._done(job, result, error),
                              _JobStop(job, self._closing))
            except Exception as e:  # noqa: BLE001 — this job's alone
                self._fail(job, e)
                continue
            with self._cv:
                if not self.running:
                    self.counters["batches"] += 1  # busy periods: the batch was empty before this job
                self.running.append(job)
                self.counters["peak_batch"] = max(self.counters["peak_batch"], len(self.running))

    def _run_alone(self, job: Job) -> None:
        if not self._start(job):
            return
        with self._cv:
            self.running, self.counters["batches"] = [job], self.counters["batches"] + 1
            self.counters["peak_batch"] = max(self.counters["peak_batch"], 1)
        try:
            result = self.engine.generate(job.request, self._on_text(job), _JobStop(job, self._closing))
        except Exception as e:  # noqa: BLE001
            self._done(job, None, e)
        else:
            self._done(job, result, None)

    def _done(self, job: Job, result: GenerationResult | None, error: Exception | None) -> None:
        with self._cv:
            self.running = [j for j in self.running if j is not job]
        if error is not None:
            self._fail(job, error)
            return
        outcome = "completed"
        if job.timed_out:
            outcome, result = "timed_out", replace(result, finish_reason="time_limit")
        elif job.cancelled.is_set():
            outcome = "cancelled"
        job.result = result
        self._finish(job, outcome, result)
        job._post("done", result)

    def _fail(self, job: Job, error: Exception) -> None:
        if not isinstance(error, (ConfigError, ContextOverflowError)):  # not the request's own fault: log it all
            log.error("request %d failed: %s", job.id, error, exc_info=error)
        with self._cv:
            self.running = [j for j in self.running if j is not job]
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
                              completion_tokens=result.completion_tokens,
                              ttft_s=None if result.ttft_s is None else round(result.ttft_s, 4))
            if error is not None:
                record["error"] = getattr(error, "what", None) or f"{type(error).__name__}: {error}"
            self.recent.append(record)
