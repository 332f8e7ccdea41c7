"""Which decode step form to run per batch size: the one graph (engine/experts/zero_copy.py) or pieces
with the planner's CPU split (engine/runtime/decode_graph.py), chosen by timing both.

Neither wins everywhere: the graph reads every miss over the link, pieces split misses with the CPU
and pay host work per layer. With a small cache pieces are 1.5x (one chat) and 2.5x (four) faster
on an H200, and at 2K with one chat the graph is. So the chooser times both forms in turns on the
live decode, keeps the faster, and re-times them now and then.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

import numpy as np

PROBE_STEPS = 4  # steps timed per form before choosing: a median one slow step hardly moves, for a few steps
# Probed forms take turns in runs of PROBE_RUN steps, and a run's first step is not timed: it pays for
# the switch (the graph's table rebuilt from the LRU after pieces changed it, once the pieces' copies
# have landed; the pieces' reading of the graph's last log). Timed step by step in turns, every graph
# step would pay that and the probe would mislead: 19.6 ms a graph step against 16.9 for pieces,
# where in steady decode pieces run 11.7 ms and the graph 9.1 (48 layers, 2K, bs=1, H200).
PROBE_RUN = 3
# Decode steps a probe takes: PROBE_STEPS timed per form in runs of PROBE_RUN − 1 timed steps, and one
# more step while the last sample is pending (a step is timed at the next one's start).
PROBE_LENGTH = 2 * PROBE_RUN * math.ceil(PROBE_STEPS / (PROBE_RUN - 1)) + 1
# Steps after which the form not in use is timed again: the hit rate, which decides between the forms,
# drifts over hundreds of steps, and a probe (PROBE_LENGTH, 13 steps) every 256 spends ~5% of them.
REPROBE_EVERY = 256
# Pieces must probe this much faster to be chosen over the one graph. The probe runs while the cache
# warms, which flatters pieces: the graph reads every miss over the link, pieces split misses with the
# CPU, so the graph gains most as hits rise: a probe can time pieces at 22.1 ms against 24.1 for the
# graph where warm decode runs pieces at 18.8 ms a step and the graph at 12.2 (2K, bs=1, 48 layers,
# H200). Where pieces is far faster (bs=4: 65–72 against 128–135 ms) the margin changes nothing.
GRAPH_MARGIN = 1.15


class ModeChooser:
    """Per batch size, which step form to run: time PROBE_STEPS steps of each, the two taking turns in
    short runs so that both see the cache as it warms (a run's first step, after the switch, untimed),
    keep the faster by median step time (pieces by more than GRAPH_MARGIN), and time both again every
    REPROBE_EVERY steps."""

    FORMS = ("graph", "pieces")

    def __init__(self):
        self.samples = defaultdict(list)  # (B, form) → step durations of the current probe, s
        self.measured: dict[tuple[int, str], float] = {}  # (B, form) → median ms at the last choice
        self.choice: dict[int, str] = {}
        self.since_choice = defaultdict(int)
        self._last: tuple[int, str, float, bool] | None = None  # (B, form, start, first of a run) of the step before
        self._run: dict[int, tuple[str, int]] = {}  # B → (form, steps so far) of the probe's current run

    def probing(self, B: int) -> bool:
        return B not in self.choice or self.since_choice[B] >= REPROBE_EVERY

    def form(self, B: int) -> str:
        if not self.probing(B):
            return self.choice[B]
        counts = {f: len(self.samples[(B, f)]) for f in self.FORMS}
        run_form, run_steps = self._run.get(B, (None, PROBE_RUN))
        if run_steps < PROBE_RUN and counts[run_form] < PROBE_STEPS:
            self._run[B] = (run_form, run_steps + 1)
            return run_form
        if min(counts.values()) < PROBE_STEPS:
            form = min(self.FORMS, key=counts.get)  # the form with fewer samples (ties: the graph)
            self._run[B] = (form, 1)
            return form
        self._run.pop(B, None)
        medians = {f: float(np.median(self.samples[(B, f)])) for f in self.FORMS}
        for f in self.FORMS:
            self.measured[(B, f)] = round(1e3 * medians[f], 3)
            self.samples[(B, f)].clear()
        self.choice[B] = "pieces" if medians["pieces"] * GRAPH_MARGIN < medians["graph"] else "graph"
        self.since_choice[B] = 0
        return self.choice[B]

    def discard(self) -> None:
        """The step before is not timed (a capture ran since it started)."""
        self._last = None

    def started(self, B: int, form: str, now: float | None = None) -> float | None:
        """Mark a step's start. The time since the last step's start is that step's duration; while
        probing it counts for that step's form (same batch size only). Returns it, or None."""
        now = time.perf_counter() if now is None else now
        first_of_run = self._run.get(B) == (form, 1)
        last, self._last = self._last, (B, form, now, first_of_run)
        if B in self.choice:
            self.since_choice[B] += 1
        if last is None or last[0] != B:
            return None
        duration = now - last[2]
        if self.probing(B) and not last[3]:
            self.samples[(B, last[1])].append(duration)
        return duration

    def telemetry(self) -> dict:
        return {"decode_form": {str(B): f for B, f in sorted(self.choice.items())},
                "step_ms": {f"{B}:{form}": ms for (B, form), ms in sorted(self.measured.items())}}
