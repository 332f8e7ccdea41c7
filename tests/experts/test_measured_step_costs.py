"""What the executor measures, and how the measurements move its split: CPU sets against their model
per phase, layer steps sync to sync, the driving thread's host parts, a CPU set's queue time."""

import time
from dataclasses import replace

import pytest
import torch

from engine.experts import measured_costs
from engine.experts import offload as offload_mod
from engine.kernels.experts_torch import moe_experts
from engine.models.moe_ffn import softmax_topk
from engine.sched.expert_cost import ExpertCostModel
from offload_helpers import QWEN3_COSTS, E, H, K, L, forward_passes, make, tiny_experts

model = pytest.fixture(scope="module", name="model")(tiny_experts)


def test_cpu_correction_follows_measured_cpu_sets_per_phase(model):
    """The median of measured / modelled CPU-set times goes to the phase's cost model once a window
    is full; the planner then sees that phase's CPU sets that much dearer (or cheaper), the other
    phase and the calibrated model are untouched."""
    ex = make("adaptive", model, 7)
    base = ex.costs
    modelled = base.cpu_ms(3, 3)
    ratios = [2.0] * (measured_costs.CPU_CORRECTION_WINDOW - 3) + [50.0, 0.01, 3.0]  # outliers are clamped, median holds
    for r in ratios:
        ex.measured.observe_cpu("decode", modelled, r * modelled)
    decode = ex.measured.model("decode")
    assert decode.cpu_correction == pytest.approx(2.0) and decode.cpu_ms(3, 3) == pytest.approx(2.0 * modelled)
    assert ex.measured.model("prefill") is base and ex.costs is base and base.cpu_correction == 1.0
    again = decode.cpu_ms(3, 3)  # the next window measures against the corrected model
    for _ in range(measured_costs.CPU_CORRECTION_WINDOW):
        ex.measured.observe_cpu("decode", again, 0.5 * again)
    assert ex.telemetry()["cpu_correction"] == {"decode": pytest.approx(1.0), "prefill": 1.0}
    x = torch.randn(2, H)  # a decode step plans with the decode model
    w, ids = softmax_topk(x @ model[2][0].T, K, True)
    ex.run(0, x, ids, w)
    assert ex.planner.costs is ex.measured.model("decode")
    ex.close()


def test_layer_steps_are_measured_sync_to_sync_by_kind(model):
    """Each layer step, from its sync to the next layer's in the same forward, is measured against its
    modelled step under its kind (split: a CPU set ran) and phase; the step into the next forward is not."""
    ex = make("adaptive", model, 7)
    seen = []
    real = ex.measured.observe_step
    ex.measured.observe_step = lambda *a: (seen.append(a), real(*a))  # noqa: E731
    forward_passes(ex, model, "cpu", n_passes=2, n_tokens=24, seed=6)
    assert len(seen) == 2 * (L - 1)  # L − 1 steps a forward end inside it
    assert all(phase == "prefill" and modelled > 0 and measured > 0 for phase, _, modelled, measured in seen)
    tel = ex.telemetry()["step_ratio"]
    assert set(tel) == {"decode", "prefill"} and tel["decode"] == {"split": 1.0, "whole": 1.0}
    ex.close()


def test_a_split_measured_dearer_than_filling_gives_way_to_fills(model):
    """Where every miss could fill, the split is taken only while its measured step (its model times
    what split steps measured) beats filling them all: split steps measured at twice their model
    send the layer's misses to the link, and the outputs still equal resident."""
    ex = make("adaptive", model, L * E, warm=False)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, H, generator=g)
    w, ids = softmax_topk(x @ model[2][0].T, K, True)
    n_active = len(torch.unique(ids))
    # a model of a link so slow that the split sends misses to the CPU
    ex.measured = measured_costs.MeasuredCosts(replace(QWEN3_COSTS, pcie_gbps=20.0))
    plan = lambda ratios: ex.planner.plan(24, list(range(n_active)), [8] * n_active, 0, 0, L * E,  # noqa: E731
                                          step_ratios=ratios)
    ex.planner.costs = ex.measured.model("prefill")
    assert plan((1.0, 1.0)).cpu  # the model alone splits
    assert plan((2.0, 1.0)).cpu  # filling all would still take longer than the split measured twice its model
    assert not plan((3.0, 1.0)).cpu and len(plan((3.0, 1.0)).fill) == n_active
    for _ in range(measured_costs.STEP_MIN_SAMPLES):
        ex.measured.observe_step("prefill", True, 1.0, 3.0)
    assert ex.measured.step_ratio("prefill", True) == pytest.approx(3.0)
    before = ex.telemetry()["cpu_executed"]
    out = ex.run(0, x, ids, w)
    assert ex.telemetry()["cpu_executed"] == before  # no CPU set: every miss filled
    torch.testing.assert_close(out, moe_experts(x, ids, w, model[0][0], model[1][0]), atol=2e-5, rtol=1e-5)
    ex.close()


def test_cheaper_cpu_moves_misses_off_the_link():
    """The split follows the correction: a CPU measured 4× faster than modelled takes more misses."""
    slow = ExpertCostModel.from_shape(2048, 768, 2)
    fast = ExpertCostModel.from_shape(2048, 768, 2, cpu_correction=0.25)
    q_slow, _, _ = slow.best_split([1] * 8, 0, 0, 8)
    q_fast, _, _ = fast.best_split([1] * 8, 0, 0, 8)
    assert q_fast < q_slow


def test_host_split_accounts_the_run_time(model):
    """The driving thread's time in `run` is the device wait, the CPU wait and the host parts."""
    ex = make("adaptive", model, 7)
    forward_passes(ex, model, "cpu", n_passes=2, n_tokens=3, seed=4)
    tel = ex.telemetry()
    split = tel["host_split_s"]
    assert set(split) == set(offload_mod.HOST_PARTS) and all(v >= 0 for v in split.values())
    accounted = sum(split.values()) + tel["device_wait_s"] + tel["cpu_wait_s"]
    assert accounted <= tel["run_s"] + 1e-9
    assert accounted >= 0.5 * tel["run_s"]  # what is left: the copies to the host before the sync
    assert tel["cpu_executed"] > 0 and split["merge"] > 0
    ex.close()


def test_cpu_set_queue_time_is_timed_apart_from_its_compute(model, monkeypatch):
    """A CPU set's wait in the worker queue (submit → start) is its own figure: a worker that starts
    late shows up there, not in cpu_expert_s."""
    from engine.experts import cpu_set as cpu_set_mod

    ex = make("cpu-only", model, 0)  # the tiny experts (I = 8) take the Python worker
    real = cpu_set_mod._run_in_worker

    def late_start(compute, submitted):
        time.sleep(0.02)  # stands in for a busy worker: the start is late, the compute is not longer
        return real(compute, submitted)

    monkeypatch.setattr(cpu_set_mod, "_run_in_worker", late_start)
    before = ex.telemetry()
    forward_passes(ex, model, "cpu", n_passes=1, n_tokens=2, seed=5)
    tel = ex.telemetry()
    sets = tel["cpu_executed"] - before["cpu_executed"]
    assert sets > 0
    assert tel["cpu_queue_s"] - before["cpu_queue_s"] >= 0.02 * L * 0.9  # one late start per layer
    assert tel["cpu_expert_s"] - before["cpu_expert_s"] < tel["cpu_queue_s"] - before["cpu_queue_s"]
    ex.close()
