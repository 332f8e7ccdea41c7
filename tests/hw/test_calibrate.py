"""Quick calibration on this machine, end to end through the API the wizard uses."""

import json
import threading
import time

import pytest
import torch

from helpers import write_tiny_llama_gguf
from hwcheck import unexplained_nulls
from engine.api import calibrate, load_profile
from engine.hw import calibrate as hw
from engine.hw.attention_kernels import NamedKernel, pick, reference_attention
from engine.hw.kv_costs import fit_costs
from engine.hw.shapes import ExpertShape, KVShape, ModelShape
from engine.hw.timing import CalibrationCancelled

TINY_PLAN = hw.Plan("test", warmup=1, repeats=3, dram_bytes=16 * 2**20, transfer_sizes=(64 * 2**10, 2**20),
                    pin_bytes=2**20, kv_batches=(1,), kv_lengths=(256, 1024, 4096), pingpong_tokens=1024,
                    expert_tokens=(1, 8), concurrency_ms=20.0)
SMALL = ModelShape("small", KVShape(4, 2, 32, "float32"), ExpertShape(64, 128, "float32"), n_layers=2,
                   n_experts=4, top_k=2)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One quick calibration of the default model, as the first-run wizard runs it."""
    path = tmp_path_factory.mktemp("quick") / "hw-profile.json"
    steps = []
    t0 = time.perf_counter()
    data = calibrate("quick", progress=lambda step, frac: steps.append((step, frac)), profile_path=str(path))
    return data, steps, time.perf_counter() - t0, path


def test_quick_calibration_is_quick_and_reports_progress(quick):
    data, steps, seconds, _ = quick
    assert seconds < 60, f"quick calibration took {seconds:.1f} s"
    fracs = [f for _, f in steps]
    assert fracs == sorted(fracs) and fracs[0] == 0.0 and steps[-1] == ("done", 1.0)
    assert len({s for s, _ in steps}) >= 4  # named steps, not one bar


def test_quick_profile_has_every_field_filled_or_marked_unavailable(quick):
    data, _, _, path = quick
    assert unexplained_nulls(data) == []
    assert data["schema"] == "tandem-hw-profile" and data["mode"] == "quick"
    assert data["memory"]["read_GBps"] > 0.1 and data["memory"]["copy_GBps"] > 0.1
    entry = data["shapes"][data["calibrated_shape"]]
    assert entry["model"] == "builtin:smollm2-135m-moe"
    kv = entry["kv"]["by_batch"]["1"]
    assert kv["A_ns_per_token"] > 0 and kv["C_cpu_ms"] >= 0
    assert len(kv["cpu_points"]) == 1 + len(hw.PLANS["quick"].kv_lengths)
    ex = entry["experts"]
    assert [p["tokens"] for p in ex["cpu_ms"]] == list(hw.PLANS["quick"].expert_tokens)
    assert all(p["ms"] > 0 for p in ex["cpu_ms"]) and ex["B_H_GBps"] > 0
    if not torch.cuda.is_available():  # a CPU-only profile says why each GPU number is missing
        assert data["transfer"]["h2d"] is None and data["transfer"]["unavailable"]["h2d"]
        assert kv["B_ns_per_token"] is None and kv["delta_ms"] is None and kv["unavailable"]["B_ns_per_token"]
        assert ex["B_P_GBps"] is None and ex["unavailable"]["B_P_GBps"]
    # What was returned is what was written, and what load_profile reads back.
    assert json.loads(path.read_text()) == data == load_profile(str(path))


def test_calibrating_another_shape_keeps_the_first(quick, tmp_path):
    data, _, _, path = quick
    target = tmp_path / "p.json"
    target.write_text(path.read_text())
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    merged = calibrate("quick", profile_path=str(target), model=str(gguf))
    assert set(merged["shapes"]) == set(data["shapes"]) | {merged["calibrated_shape"]}
    assert merged["calibrated_shape"] != data["calibrated_shape"]
    assert merged["shapes"][merged["calibrated_shape"]]["experts"]["cpu_ms"] is None  # dense: said why
    assert unexplained_nulls(merged) == []


def test_cancel_stops_and_keeps_the_previous_profile(tmp_path):
    target = tmp_path / "p.json"
    target.write_text("previous")
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    cancel = threading.Event()

    def progress(step, frac):
        if frac > 0:
            cancel.set()

    with pytest.raises(CalibrationCancelled):
        calibrate("quick", progress=progress, profile_path=str(target), model=str(gguf), cancel=cancel)
    assert target.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_attention_cost_is_measured_through_the_injected_kernel():
    """A kernel that spends 2 µs per KV token on top of the reference shows up as A ≳ 2000 ns
    (the reference alone costs a few ns per token on this shape)."""
    def slow(q, k, v, scale):
        until = time.perf_counter() + 2e-6 * k.shape[0] * k.shape[2]
        while time.perf_counter() < until:
            pass
        return reference_attention(q, k, v, scale)

    kernels = hw.Kernels(cpu_attention=NamedKernel("slow-reference", slow))
    data = hw.calibrate(SMALL, kernels=kernels, plan=TINY_PLAN, use_cuda=False)
    kv = data["shapes"][SMALL.key]["kv"]
    assert kv["cpu_kernel"] == "slow-reference"
    assert kv["by_batch"]["1"]["A_ns_per_token"] > 1500


def test_calibration_times_the_cpu_kernels_the_engine_runs():
    """The CPU costs are those of the engine's own kernels (the native ones where built): a profile
    of torch's kernels had the planner and the KV split plan with rates several times too low."""
    from engine.kernels import attention_cpu, experts_cpu

    entry = hw.calibrate(SMALL, plan=TINY_PLAN, use_cuda=False)["shapes"][SMALL.key]
    assert entry["kv"]["cpu_kernel"] == attention_cpu.kernel_name(torch.float32, 4, 2, 32)
    assert entry["experts"]["cpu_kernel"].startswith(experts_cpu.implementation(1))


# The spell's extra seconds per call: far above what the reference attention of 1024 tokens takes
# even on a loaded 2-core machine (29 ms seen), so "the faster pass counts" is told apart from load.
SPELL_S = 0.3


def test_a_slow_spell_during_one_step_size_does_not_skew_the_cpu_attention_cost():
    """On the H200's host a single step size now and then timed 10-40x the others (phase CW), and the
    fitted A came out 0 or 17x too large. Each size is timed twice apart and the faster counts: here
    the 1024-token step is slow throughout the first pass only."""
    calls = {}

    def spell(q, k, v, scale):
        L = k.shape[2]
        calls[L] = calls.get(L, 0) + 1
        if L == 1024 and calls[L] <= TINY_PLAN.warmup + TINY_PLAN.repeats:
            time.sleep(SPELL_S)
        return reference_attention(q, k, v, scale)

    data = hw.calibrate(SMALL, kernels=hw.Kernels(cpu_attention=NamedKernel("spell", spell)), plan=TINY_PLAN,
                        use_cuda=False)
    points = dict(data["shapes"][SMALL.key]["kv"]["by_batch"]["1"]["cpu_points"])
    assert calls[1024] == hw.KV_PASSES * (TINY_PLAN.warmup + TINY_PLAN.repeats)
    assert points[1024] < 1e3 * SPELL_S / 2  # ms: the second pass's median, not the spell's


def test_a_kernel_that_fails_or_disagrees_is_replaced_by_the_reference():
    def broken(q, k, v, scale):
        raise RuntimeError("not on this machine")

    def wrong(q, k, v, scale):
        out, lse = reference_attention(q, k, v, scale)
        return out * 0, lse

    for fn in (broken, wrong):
        chosen, why = pick(NamedKernel(fn.__name__, fn), 8, 2, 32, torch.float32, torch.device("cpu"))
        assert chosen.name == "torch-matmul-reference" and fn.__name__ in why


def test_a_fit_that_slopes_down_takes_the_longest_steps_time_per_token():
    """A busy host slowed the short steps past the long one: the slope is no cost, and 0 would make
    tokens free. The longest step's time per token stands for it."""
    ns, fixed = fit_costs([(16, 0.9), (1024, 0.3), (8192, 0.5)])
    assert ns == pytest.approx(0.5 / 8192 * 1e6) and ns > 0
    assert fixed == pytest.approx(max(0.9 - 16 * 0.5 / 8192, 0.0))


def test_fit_recovers_per_token_cost_and_fixed_overhead():
    points = [(16, 0.05 + 16 * 2e-6), (1024, 0.05 + 1024 * 2e-6), (8192, 0.05 + 8192 * 2e-6)]
    ns, fixed = fit_costs(points)
    assert ns == pytest.approx(2.0, rel=1e-6) and fixed == pytest.approx(0.05, rel=1e-6)
