"""The decode-form chooser (engine/experts/mode_chooser.py) driven with scripted step costs: it times
both forms in turns, keeps the faster, does not time the step that pays for a switch, and keeps the
graph unless pieces wins by the margin."""

import pytest

from engine.experts.mode_chooser import GRAPH_MARGIN, PROBE_LENGTH, PROBE_RUN, PROBE_STEPS, REPROBE_EVERY, ModeChooser


class _Steps:
    """Drives a ModeChooser at batch size 1 with scripted step costs (s): cost[form], plus switch_cost[form]
    for a step whose form differs from the step before."""

    def __init__(self, cost: dict, switch_cost: dict | None = None):
        self.ch, self.now, self.forms = ModeChooser(), 0.0, []
        self.cost, self.switch_cost = cost, switch_cost or {}

    def __call__(self, n: int) -> None:
        for _ in range(n):
            form = self.ch.form(1)
            switched = bool(self.forms) and self.forms[-1] != form
            self.forms.append(form)
            self.ch.started(1, form, self.now)
            self.now += self.cost[form] + (self.switch_cost.get(form, 0.0) if switched else 0.0)


def test_mode_chooser_times_both_forms_in_turns_then_keeps_the_faster():
    run = _Steps({"graph": 0.010, "pieces": 0.030})
    run(PROBE_LENGTH - 1)
    assert 1 not in run.ch.choice  # the probe takes PROBE_LENGTH steps, which the bench's warm-up covers
    run(2)
    probe = run.forms[:PROBE_LENGTH]
    assert probe.count("graph") >= PROBE_STEPS and probe.count("pieces") >= PROBE_STEPS
    assert "pieces" in probe[:PROBE_RUN + 1]  # in turns, not one form after the other
    assert run.ch.choice[1] == "graph" and run.forms[-1] == "graph"
    assert run.ch.telemetry()["step_ms"] == {"1:graph": 10.0, "1:pieces": 30.0}
    run(20)
    assert set(run.forms[-20:]) == {"graph"}
    # both are timed again after REPROBE_EVERY steps; the other wins if it became faster
    run.cost["pieces"] = 0.005
    run(REPROBE_EVERY + PROBE_LENGTH + 2)
    assert run.ch.choice[1] == "pieces"
    run.ch.discard()
    assert run.ch.started(1, "pieces", run.now + 5.0) is None  # a capture in between is not a step


def test_mode_chooser_does_not_time_the_step_that_pays_for_a_switch():
    """Switching to the graph costs a rebuild of its table (10 ms here): timed in every probe step, that
    made the graph look slower than pieces (20 ms against 12) although it runs 10 ms a step."""
    run = _Steps({"graph": 0.010, "pieces": 0.012}, switch_cost={"graph": 0.010})
    run.forms = ["pieces"]  # the steps before ran in pieces (another policy, or the last choice)
    run(PROBE_LENGTH + 1)
    assert run.ch.choice[1] == "graph"
    assert run.ch.telemetry()["step_ms"] == {"1:graph": 10.0, "1:pieces": 12.0}


@pytest.mark.parametrize("pieces_ms, chosen", [(9.0, "graph"), (8.0, "pieces")])
def test_mode_chooser_keeps_the_graph_unless_pieces_wins_by_the_margin(pieces_ms, chosen):
    """The probe runs on a warming cache, which flatters pieces: pieces must be more than GRAPH_MARGIN
    faster to be chosen (10 ms against 9 keeps the graph, against 8 takes pieces)."""
    assert 10.0 / 9.0 < GRAPH_MARGIN < 10.0 / 8.0
    run = _Steps({"graph": 0.010, "pieces": pieces_ms / 1e3})
    run(PROBE_LENGTH + 1)
    assert run.ch.choice[1] == chosen
