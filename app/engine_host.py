"""The GUI side of the engine's thread (app/worker.py): EngineHost owns the QThread that the
EngineWorker runs on, forwards every request to it as a queued signal, tracks the engine's state
(empty | loading | ready | failed | closed) and the running job, and samples stats while idle.

Stop is the one request that is not a signal: it sets the job's `threading.Event`, which the engine
checks between steps, so it takes effect while the worker thread is busy generating.
"""

from __future__ import annotations

import threading

from PySide6.QtCore import QObject, QThread, QTimer, Signal

from app.worker import EngineWorker

IDLE_SAMPLE_HZ = 2  # stats snapshots a second while no reply streams (the live panels)


class EngineHost(QObject):
    """The GUI side: owns the worker's thread, forwards requests, tracks state, samples stats when idle."""

    _load = Signal(dict)
    _adopt = Signal()
    _generate = Signal(str, dict, object)
    _plan = Signal(int, dict)
    _count = Signal(int, str)
    _sample = Signal()
    _end_session = Signal(str)
    _close = Signal()

    state_changed = Signal(str)  # empty | loading | ready | failed | closed

    def __init__(self, engine=None, parent=None):
        super().__init__(parent)
        self.worker = EngineWorker(engine)
        self.thread = QThread()
        self.thread.setObjectName("tandem-engine")
        self.worker.moveToThread(self.thread)
        for sig, slot in ((self._load, self.worker.load), (self._adopt, self.worker.adopt),
                          (self._generate, self.worker.generate), (self._plan, self.worker.plan),
                          (self._count, self.worker.count), (self._sample, self.worker.sample),
                          (self._end_session, self.worker.end_session),
                          (self._close, self.worker.close)):
            sig.connect(slot)
        w = self.worker
        w.loaded.connect(self._on_loaded)
        w.load_failed.connect(self._on_load_failed)  # bound methods: a lambda would run on the worker thread
        w.finished.connect(self._job_done)
        w.failed.connect(self._job_done)
        w.stats.connect(self._on_stats)
        self.thread.start()
        self.state = "empty"
        self.info: dict | None = None
        self.job: str | None = None
        self.stop_event: threading.Event | None = None
        self._sample_pending = False
        self._next_request = 0
        self._timer = QTimer(self)
        self._timer.setInterval(int(1000 / IDLE_SAMPLE_HZ))
        self._timer.timeout.connect(self._tick)
        self._timer.start()
        if engine is not None:
            self._set_state("loading")
            self._adopt.emit()

    def _set_state(self, state: str) -> None:
        self.state = state
        self.state_changed.emit(state)

    def _on_loaded(self, info: dict) -> None:
        self.info = info
        self._set_state("ready")

    def _on_load_failed(self, what: str, remedy: str) -> None:
        self._set_state("failed")

    @property
    def busy(self) -> bool:
        return self.job is not None

    def load(self, config: dict) -> None:
        self.info = None
        self._set_state("loading")
        self._load.emit(dict(config))

    def generate(self, job_id: str, request: dict) -> None:
        self.job = job_id
        self.stop_event = threading.Event()
        self._generate.emit(job_id, dict(request), self.stop_event)

    def stop(self) -> None:
        if self.stop_event is not None:
            self.stop_event.set()

    def _job_done(self, job_id: str, *rest) -> None:
        if job_id == self.job:
            self.job, self.stop_event = None, None

    def _request_id(self) -> int:
        self._next_request += 1
        return self._next_request

    def plan(self, args: dict) -> int:
        rid = self._request_id()
        self._plan.emit(rid, dict(args))
        return rid

    def count(self, text: str) -> int:
        rid = self._request_id()
        self._count.emit(rid, text)
        return rid

    def end_session(self, session_id: str) -> None:
        self._end_session.emit(session_id)

    def _tick(self) -> None:
        if self.state == "ready" and not self.busy and not self._sample_pending:
            self._sample_pending = True
            self._sample.emit()

    def _on_stats(self, snap: dict) -> None:
        self._sample_pending = False

    def shutdown(self, timeout_s: float = 60.0) -> bool:
        """Stop any reply, close the engine on its thread (freeing its memory), join the thread."""
        if self.state == "closed":
            return True
        self._timer.stop()
        self.stop()
        self.worker.cancel_load.set()
        self._close.emit()  # queued behind a running generate, which the stop event ends at its next step
        joined = self.thread.wait(int(timeout_s * 1000))
        self._set_state("closed")
        return joined
