"""How every calibration number is taken: warm-up runs, repeated runs, the median.

CPU work is timed with perf_counter around the call. Work that touches the GPU is timed with CUDA
events recorded on the stream that runs it, and the host waits for the end event before the next
repeat, so queued work never leaks from one sample into the next.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.errors import TandemError


GPU = "cuda"  # the device every GPU measurement runs on (torch's current CUDA device)


class CalibrationCancelled(TandemError):
    """The caller asked calibration to stop; nothing was written."""


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    repeats: int

    def to_dict(self) -> dict:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms, "repeats": self.repeats}


def _summary(samples_ms: list[float]) -> Timing:
    return Timing(statistics.median(samples_ms), min(samples_ms), max(samples_ms), len(samples_ms))


def time_cpu(fn: Callable[[int], object], warmup: int, repeats: int) -> Timing:
    """fn(i) runs once per call (i counts calls, for rotating inputs); returns the timing of fn."""
    for i in range(warmup):
        fn(i)
    samples = []
    for i in range(warmup, warmup + repeats):
        t0 = time.perf_counter()
        fn(i)
        samples.append((time.perf_counter() - t0) * 1e3)
    return _summary(samples)


def time_cuda(fn: Callable[[int], object], warmup: int, repeats: int, stream=None) -> Timing:
    """Like time_cpu, but timed by CUDA events on `stream` (default: the current stream)."""
    stream = stream or torch.cuda.current_stream()
    for i in range(warmup):
        with torch.cuda.stream(stream):
            fn(i)
    stream.synchronize()
    samples = []
    for i in range(warmup, warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            fn(i)
            end.record(stream)
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return _summary(samples)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of y = slope·x + intercept (needs two distinct x)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_line needs at least two distinct x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


class Progress:
    """Reports (step, fraction of the whole run) and stops the run when `cancel` is set.

    Fractions come from step weights declared up front, so the bar moves by expected time, not by
    step count.
    """

    def __init__(self, weights: dict[str, float], callback: Callable[[str, float], None] | None,
                 cancel: threading.Event | None):
        total = sum(weights.values()) or 1.0
        self._start: dict[str, float] = {}
        acc = 0.0
        for name, w in weights.items():
            self._start[name] = acc / total
            acc += w
        self._weight = {name: w / total for name, w in weights.items()}
        self.callback, self.cancel = callback, cancel

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise CalibrationCancelled("calibration was cancelled", "the previous profile is kept; run it again")

    def step(self, name: str, within: float = 0.0, label: str | None = None) -> None:
        """Entering `name` (or `within` of the way through it); raises CalibrationCancelled if asked."""
        self.check()
        if self.callback is not None:
            frac = self._start[name] + self._weight[name] * min(max(within, 0.0), 1.0)
            self.callback(label or name, round(frac, 4))

    def done(self) -> None:
        if self.callback is not None:
            self.callback("done", 1.0)
