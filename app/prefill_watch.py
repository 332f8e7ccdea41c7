"""How far the engine has read a long prompt (the worker's side thread).

While the worker thread is inside `Engine.generate` and no token has come yet, this thread samples
`Engine.stats()` a few times a second (safe from any thread while a generation runs) and forwards
the engine's own count of the prompt being read: `speed.prefill_done` of `speed.prefill_total`.
"""

from __future__ import annotations

import threading
import time

STATS_INTERVAL_S = 0.25
PREFILL_REPORT_MIN_TOKENS = 256  # shorter prompts are read in well under a second: nothing to show


class PrefillWatch(threading.Thread):
    def __init__(self, worker, job_id: str, first_text: threading.Event):
        super().__init__(name="tandem-prefill-watch", daemon=True)
        self.worker, self.job_id, self.first_text = worker, job_id, first_text

    def run(self) -> None:
        engine = self.worker.engine
        while not self.first_text.wait(STATS_INTERVAL_S):
            try:
                snap = engine.stats().to_dict()
            except Exception:  # noqa: BLE001 — a closed engine mid-quit: the job ends anyway
                return
            snap["t"] = time.time()
            self.worker.stats.emit(snap)
            speed = snap.get("speed") or {}
            done, total = speed.get("prefill_done"), speed.get("prefill_total")
            if snap.get("phase") == "prefill" and total and total >= PREFILL_REPORT_MIN_TOKENS:
                self.worker.prefill_progress.emit(self.job_id, done, total)

    def finish(self) -> None:
        if self.is_alive():
            self.join()
