"""ThreadChooser: how many CPU threads a decode step runs on, chosen by measured step time.

The CPU kernels split each product across threads and wait at its end for the slowest. When another
program keeps one of the cores busy, the thread the OS puts there runs part of the time and every
product waits for it (the suite cell cpu-busy-core measures it: benchmarks/suite/cpu-busy-core.json,
where llama.cpp on both of the development machine's cores decoded the built-in model at 1.6 tok/s
with one core busy). A desktop's cores are often busy with something else, so the count is measured, not
assumed: decode steps run at the current count and now and then at one thread fewer, half as many or
one more, and the faster count stays. While the choice holds, probes grow rarer (the interval doubles up to
MAX_INTERVAL steps); a step time that moves by more than SHIFT (the load changed) probes again soon.
"""

from __future__ import annotations

from statistics import median
from typing import Callable

BUSY_PERCENT = 50  # a core this busy with other work at the start does not get a thread to begin with

SETTLE = 2  # steps after a change of count that are not measured (the thread pool resizes); a trial waits 1
WINDOW = 4  # steps measured per count in a comparison: medians of 4 steps of 10-100 ms
MIN_INTERVAL = 16  # steps between probes once the current count has won one (a probe costs up to WINDOW
# steps at the other count); at the start, after a change or a shift in load: WINDOW, so that a busy core
# is found within ~10 steps and a walk down from 16 threads takes a step per probe
MAX_INTERVAL = 512  # while the choice holds: probing 4 of 512 steps costs < 1% when it is right
# When every core was free as decode began (from_free_cores), the first trial waits this many steps (a
# chat reply's length) unless the step time shifts (another program started): on an idle machine the
# early trials of fewer threads only cost time (a few % of a short reply on the 2-core machine)
IDLE_START_INTERVAL = 128
MARGIN = 0.05  # a count replaces the current one only if its median step is this much faster
SETTLE_ABORT = 3.0  # the trial's first step (the pool resizing) may be slower, but not this much
ABORT = 1.5  # a trial step this much slower than the current count's ends the trial at once: with a core
# busy, a step on one thread too many took 10x as long (0.2 s against 0.02 on the 2-core machine)
SHIFT = 0.5  # the current count's step time moved by this share: the load changed, probe soon


def free_cores(cores: set[int] | None = None, seconds: float = 0.1) -> int:
    """How many of `cores` (CPU ids; None: this process's) were less than BUSY_PERCENT busy over the next
    `seconds`: where the count starts, so that a one-off `tandem generate` does not spend its first
    steps finding a busy core."""
    import os

    import psutil

    if cores is None:
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    busy = psutil.cpu_percent(interval=seconds, percpu=True)  # per CPU id, the whole machine's work
    return max(1, sum(1 for c in cores if c < len(busy) and busy[c] < BUSY_PERCENT))


class ThreadChooser:
    """Feed it every decode step's wall time (`step`); it calls `apply(n)` when the count changes.
    `start`: the count to begin with (free_cores), max_threads by default."""

    def __init__(self, max_threads: int, apply: Callable[[int], None], start: int | None = None,
                 all_free: bool = False):
        """all_free: every core was found free at the start (the first trial waits IDLE_START_INTERVAL)."""
        self.max_threads, self.apply = max_threads, apply
        self.threads = min(max_threads, start or max_threads)
        self.interval = IDLE_START_INTERVAL if all_free else WINDOW
        self.changes = self.probes = 0
        self._batch: int | None = None
        self._reset()

    @classmethod
    def from_free_cores(cls, max_threads: int, apply: Callable[[int], None]) -> ThreadChooser:
        """A chooser that starts on the cores found free now, that count applied."""
        start = min(max_threads, free_cores())
        apply(start)
        return cls(max_threads, apply, start, all_free=start == max_threads)

    def _reset(self) -> None:
        self._skip = SETTLE
        self._current: list[float] = []  # the current count's recent steps
        self._reference: float | None = None  # its median when last compared
        self._since_probe = 0
        self._probe: int | None = None  # the count under trial
        self._probe_times: list[float] = []

    def step(self, seconds: float, batch: int = 1) -> None:
        """One decode step of `batch` sequences took `seconds` (wall) at the count last applied."""
        if batch != self._batch:  # steps of another batch size do not compare: start over
            if self._probe is not None:  # (a trial under way: back to the chosen count first)
                self.apply(self.threads)
            self._batch = batch
            self._reset()
        if self._skip:
            self._skip -= 1
            if self._probe is not None and seconds > SETTLE_ABORT * self._reference:  # hopeless even allowing
                self._probe_times.append(seconds)  # for the pool's resize: end the trial now
                self._decide()
            return
        if self._probe is not None:
            self._probe_times.append(seconds)
            if len(self._probe_times) >= WINDOW or seconds > ABORT * self._reference:
                self._decide()
            return
        self._current = (self._current + [seconds])[-WINDOW:]
        self._since_probe += 1
        now = median(self._current) if len(self._current) == WINDOW else None
        if now is not None and self._reference is None:
            self._reference = now  # the count's first full window: what a shift in load is measured from
        if now is not None and abs(now - self._reference) > SHIFT * self._reference:
            self.interval = WINDOW  # the load changed: look again soon
            self._reference = now
        if now is not None and self._since_probe >= self.interval:
            self._start_probe(now)

    def _start_probe(self, now: float) -> None:
        # one fewer, half and one more in turn (fewer first: a core taken by another program is the usual
        # change; half because the steps are as slow at any count above the free cores: no slope to follow)
        candidates = list(dict.fromkeys(n for n in (self.threads - 1, self.threads // 2, self.threads + 1)
                                        if 1 <= n <= self.max_threads and n != self.threads))
        if not candidates:
            return
        self._reference = now
        self._probe = candidates[self.probes % len(candidates)]
        self._probe_times, self._skip = [], 1  # one step for the pool to resize, then each step counts
        self.apply(self._probe)

    def _decide(self) -> None:
        self.probes += 1
        trial, probe = median(self._probe_times), self._probe
        self._probe = None
        if trial < (1 - MARGIN) * self._reference:
            self.threads = probe
            self.changes += 1
            self.interval = WINDOW
            self._current, self._reference = [], None
        else:
            self.apply(self.threads)
            self.interval = min(MAX_INTERVAL, max(MIN_INTERVAL, 2 * self.interval))
        self._since_probe = 0
        self._skip = SETTLE

    def telemetry(self) -> dict:
        return {"cpu_threads_now": self.threads, "cpu_threads_max": self.max_threads,
                "cpu_thread_changes": self.changes, "cpu_thread_probes": self.probes}
