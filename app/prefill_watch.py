"""How far the engine has read a long prompt, from its own counters (the worker's side thread).

The engine reports no per-prompt progress, but its KV token count grows with every chunk it reads,
and `Engine.stats()` may be called from any thread while a generation runs (engine telemetry).
"""

from __future__ import annotations

import threading
import time

STATS_INTERVAL_S = 0.25
PREFILL_REPORT_MIN_TOKENS = 256  # shorter prompts are read in well under a second: nothing to show


def kv_tokens(snap: dict) -> int:
    """Every token the engine's KV holds now, over all its regions and chats."""
    return sum(v for v in ((snap.get("kv") or {}).get("tokens") or {}).values() if v)


class PrefillWatch(threading.Thread):
    """While the engine reads a prompt, sample its stats a few times a second (the worker thread is
    inside generate, and no token comes yet to sample from) and say how far the reading got.

    The engine reports no per-prompt progress, but its KV token count grows by every chunk it reads:
    prompt tokens in the KV = what the chat kept from its last reply (`kept`) + the growth since the
    job began (a crop of what changed counts as negative growth, so an edit comes out right too).
    `Engine.stats()` is safe to call from another thread while a generation runs (engine telemetry)."""

    def __init__(self, worker, job_id: str, total: int | None, base: int | None, kept: int, first_text):
        super().__init__(name="tandem-prefill-watch", daemon=True)
        self.worker, self.job_id, self.total, self.base, self.kept = worker, job_id, total, base, kept
        self.first_text = first_text

    def in_kv(self, snap: dict) -> int:
        return max(0, min(self.total, self.kept + kv_tokens(snap) - self.base))

    def run(self) -> None:
        engine = self.worker.engine
        while not self.first_text.wait(STATS_INTERVAL_S):
            try:
                snap = engine.stats().to_dict()
            except Exception:  # noqa: BLE001 — a closed engine mid-quit: the job ends anyway
                return
            snap["t"] = time.time()
            self.worker.stats.emit(snap)
            if snap.get("phase") == "prefill":
                self.worker.prefill_progress.emit(self.job_id, self.in_kv(snap), self.total)

    def finish(self, session_id: str | None) -> None:
        """After the job: remember what the chat's KV holds, for its next prompt's progress."""
        if self.is_alive():
            self.join()
        if session_id is None or self.base is None or self.worker.engine is None:
            return
        try:
            now = kv_tokens(self.worker.engine.stats().to_dict())
        except Exception:  # noqa: BLE001
            return
        self.worker.session_tokens[session_id] = max(0, self.kept + now - self.base)
