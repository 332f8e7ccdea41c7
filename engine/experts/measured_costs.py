"""The expert cost model corrected online by what this machine's layer steps measure: the one decider
of what the CPU computes, with prefill and decode as its two inputs.

The calibrated model (sched/expert_cost.py) predicts a layer's two sides. Measurements per phase
(prefill and decode run different kernels and token counts, so their errors differ) correct it:

- **CPU sets**: measured / modelled CPU-set time. Its median scales T_C, so the split's q balances the
  two sides as they really run here (threads, contention, kernel). Where decode runs as the one graph,
  its CPU share is answered by the mailbox's worker, whose posts give a line (a post's fixed cost and
  an expert's); that line sets the decode model's CPU costs instead (`observe_cpu_line`), and the
  device's split reads them back (engine/experts/cpu_mailbox.py's MissSplit).
- **Layer steps**: the wall time from one MoE layer's sync to the next layer's, against the modelled
  step (the layer's makespan plus the next layer's attention), kept apart for *split* steps (a CPU
  set ran) and *whole* steps (none). A split costs more than its CPU set's compute: the hand-over, the
  result's copy back and merge, and fills slowed by the CPU's own DRAM reads. None of that is in the
  model, all of it is in the measured step. The planner takes a split only where its corrected step
  beats the corrected step of filling every miss (`MissPlanner.plan`).

Until a kind of step has been measured its ratio is 1 (the model is trusted), so an untried choice is
tried once the other has shown its cost.

Pure arithmetic on floats; no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from statistics import median

from engine.sched.expert_cost import ExpertCostModel

PHASES = ("decode", "prefill")
# CPU sets whose measured / modelled ratio the correction is the median of: under one decode step of a
# 48-layer model, so it follows a change within a step, and a stray slow set does not move it.
CPU_CORRECTION_WINDOW = 32
# Layer steps of one kind whose ratio is the rolling median: half a 16-layer forward, so a prefill of a
# few forwards measures both kinds; a median of 8 ignores the odd step stalled by another process.
STEP_WINDOW = 8
STEP_MIN_SAMPLES = 3  # fewer measured steps of a kind: its ratio stays 1
RATIO_BOUNDS = (0.1, 20.0)  # a ratio past these is a stall or a clock glitch, not the model's error


def _clamp(ratio: float) -> float:
    return min(max(ratio, RATIO_BOUNDS[0]), RATIO_BOUNDS[1])


class MeasuredCosts:
    """Per phase: the cost model with its CPU correction, and the split / whole step ratios."""

    def __init__(self, costs: ExpertCostModel):
        self._models = dict.fromkeys(PHASES, costs)
        self._cpu_ratios = {phase: deque(maxlen=CPU_CORRECTION_WINDOW) for phase in PHASES}
        self._steps = {(phase, split): deque(maxlen=STEP_WINDOW) for phase in PHASES for split in (True, False)}
        self._step_ratios = dict.fromkeys(self._steps, 1.0)  # the medians, kept as steps come: read every layer

    def model(self, phase: str) -> ExpertCostModel:
        return self._models[phase]

    def observe_cpu(self, phase: str, modelled_ms: float, measured_ms: float) -> None:
        """One CPU set: modelled by `model(phase)` (its correction included), measured by its worker.
        A full window hands its median to the phase's model and starts again."""
        costs = self._models[phase]
        base = modelled_ms / costs.cpu_correction  # the model's time without the correction
        if base <= 0:
            return
        ratios = self._cpu_ratios[phase]
        ratios.append(_clamp(measured_ms / base))
        if len(ratios) == ratios.maxlen:
            self._models[phase] = replace(costs, cpu_correction=float(median(ratios)))
            ratios.clear()

    def observe_cpu_line(self, phase: str, expert_ms: float, post_ms: float) -> None:
        """The CPU's measured cost of a set as a line: post_ms for the set plus expert_ms an expert (one
        token each). The phase's model then says the same: its correction scales the modelled expert to
        expert_ms, and its per-set overhead becomes post_ms."""
        costs = self._models[phase]
        base = costs.cpu_expert_ms(1) / costs.cpu_correction  # the model's expert without the correction
        if base <= 0 or expert_ms <= 0 or post_ms < 0:
            return
        correction = _clamp(expert_ms / base)
        self._models[phase] = replace(costs, cpu_correction=correction, cpu_overhead_ms=post_ms / correction)
        self._cpu_ratios[phase].clear()  # sets measured against the old model would pull it back

    def observe_step(self, phase: str, split: bool, modelled_ms: float, measured_ms: float) -> None:
        """One layer step (sync to the next layer's sync, ms) and what the model said it would take."""
        if modelled_ms <= 0:
            return
        steps = self._steps[(phase, split)]
        steps.append(_clamp(measured_ms / modelled_ms))
        if len(steps) >= STEP_MIN_SAMPLES:
            self._step_ratios[(phase, split)] = float(median(steps))

    def step_ratio(self, phase: str, split: bool) -> float:
        """Measured / modelled step time of that kind: the rolling median, 1 until measured."""
        return self._step_ratios[(phase, split)]

    def telemetry(self) -> dict:
        return {"cpu_correction": {phase: self._models[phase].cpu_correction for phase in PHASES},
                "step_ratio": {phase: {"split": self.step_ratio(phase, True), "whole": self.step_ratio(phase, False)}
                               for phase in PHASES}}
