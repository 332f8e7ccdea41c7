"""The starting A and B of a WriteScope backend timed with its own kernels (engine/kv/cost_probe.py),
and which start kv_setup picks: a profile that measured the shape, else on a GPU the probe."""

import time

import pytest
import torch

from engine.hw.profile import KVCosts
from engine.kv import cost_probe
from engine.kv.inplace import PartitionSpec
from engine.kv.latent import LatentWriteScopeKV
from engine.kv.writescope import WriteScopeKV
from engine.runtime import kv_setup
from engine.sched.roofline import RooflineParams

LAYERS, NH, NKV, HS = 2, 4, 2, 8
SPEC = dict(block_size=4, d_window=8, pingpong_tokens=24)
SMALL = dict(rows=2, row_tokens=256, copies=2)  # the probe's working set, small for a test
PAUSE_S = 0.004  # the slowed kernels' sleep: far above what the tiny shapes cost


def make(cls=WriteScopeKV, params=RooflineParams(30.0, 10.0, 0.25, 0.05), **kw):
    spec = PartitionSpec(**SPEC, roofline=params)
    return cls(LAYERS, NKV, HS, spec=spec, max_context=400, max_batch=2, device=torch.device("cpu"),
               dtype=torch.float32, **kw)


class SlowCPU(WriteScopeKV):
    def attend_cpu(self, q_host, blocks, scale, *, out=None, lse=None):
        time.sleep(PAUSE_S)
        return super().attend_cpu(q_host, blocks, scale, out=out, lse=lse)


class SlowDevice(WriteScopeKV):
    def device_part(self, q, k, v, scale, **kw):
        time.sleep(PAUSE_S)
        return super().device_part(q, k, v, scale, **kw)


def test_the_probe_times_the_backends_own_kernels_and_keeps_its_fixed_costs():
    fast = make()
    params = cost_probe.measure_costs(fast, NH, **SMALL)
    assert 0 < params.A_ns_per_token < float("inf") and 0 < params.B_ns_per_token < float("inf")
    assert (params.delta_ms, params.c_cpu_ms) == (0.25, 0.05)  # the probe times per-token costs only
    tokens = SMALL["rows"] * SMALL["row_tokens"]
    backends = [fast, make(SlowCPU), make(SlowDevice)]
    slow_cpu = cost_probe.measure_costs(backends[1], NH, **SMALL)
    assert slow_cpu.A_ns_per_token >= (PAUSE_S * 1e3 - 0.05) * 1e6 / tokens  # the sleep, less C_CPU
    assert slow_cpu.A_ns_per_token > 10 * params.A_ns_per_token
    slow_gpu = cost_probe.measure_costs(backends[2], NH, **SMALL)
    n = fast.cache.pingpong[0].shape[0]  # one ping-pong load's tokens
    assert slow_gpu.B_ns_per_token >= PAUSE_S * 1e9 / n
    assert slow_gpu.A_ns_per_token < slow_cpu.A_ns_per_token
    for kv in backends:
        kv.close()


def test_a_prompt_arriving_first_is_placed_by_the_probed_costs():
    """The bug it fixes: with no profile the first prompt was placed by the bandwidth defaults, and a
    placed token never moves. A CPU kernel made slow must pull the first prompt's share down."""
    kv = make(SlowCPU, params=RooflineParams(10.0, 10.0, 0.0, 0.05))  # defaults: r = 0.5
    kv.calibrate(cost_probe.measure_costs(kv, NH, **SMALL), "measured at setup")
    assert kv.telemetry()["costs_from"] == "measured at setup"
    s = kv.new_sequence()
    kv.begin_step([s], 96)
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        q = torch.randn(1, NH, 96, HS, generator=g)
        k, v = (torch.randn(1, NKV, 96, HS, generator=g) for _ in range(2))
        kv.attend(layer, q, k, v)
    kv.end_step()
    tel = kv.telemetry()
    assert tel["r_target"] < 0.1 and tel["r_deployed"] < 0.2
    kv.close()


def test_the_latent_backend_probes_its_mla_kernel_over_whole_rows():
    spec = PartitionSpec(**SPEC, roofline=RooflineParams(30.0, 10.0, 0.0, 0.05))
    row, rank = 2 * HS, HS  # a row of r + dr = 16 columns, r = 8 of them the values
    kv = LatentWriteScopeKV(LAYERS, row, rank, spec=spec, max_context=400, max_batch=2,
                            device=torch.device("cpu"), dtype=torch.float32)
    assert kv.query_width == row and kv.cache.head_dim == row // 2
    params = cost_probe.measure_costs(kv, NH, **SMALL)
    assert 0 < params.A_ns_per_token < float("inf") and 0 < params.B_ns_per_token < float("inf")
    kv.close()


class _Profile:
    """A profile that answers with fixed KV costs, measured for the asked shape or scaled."""

    def __init__(self, source):
        self.source = source

    def kv_costs(self, shape, batch):
        return KVCosts(7.0, 3.0, 0.1, 0.05, source=self.source)


class _Args:
    n_heads, n_kv_heads, head_dim = NH, NKV, HS


@pytest.mark.parametrize("gpu,profile_source,expect", [
    (False, None, "defaults"),
    (False, "scaled from another", "calibration profile"),  # a CPU-only machine: the scaled profile beats the defaults
    (True, "measured", "calibration profile"),
    (True, "scaled from another", "measured at setup"),  # a GPU times the shape it has rather than scale one
    (True, None, "measured at setup"),
])
def test_the_estimators_start_from_a_measurement_of_this_shape(monkeypatch, gpu, profile_source, expect):
    probed = []
    monkeypatch.setattr(kv_setup, "measure_costs",
                        lambda kv, n_heads: probed.append(n_heads) or RooflineParams(1.0, 2.0, 0.0, 0.05))
    kv = make()
    kv.transport.cuda = gpu  # only the choice is under test here; the probe itself is stubbed above
    try:
        profile = None if profile_source is None else _Profile(profile_source)
        kv_setup._start_costs(kv, profile, _Args, torch.float32, 2)
        assert kv.costs_from == expect
        assert probed == ([NH] if expect == "measured at setup" else [])
        A = kv.telemetry()["A_ns_per_token"]
        assert A == {"defaults": 30.0, "calibration profile": 7.0, "measured at setup": 1.0}[expect]
    finally:
        kv.transport.cuda = False
        kv.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("latent", [False, True])
def test_on_a_gpu_the_probe_times_a_page_locked_load_and_the_host_kernel(latent):
    spec = PartitionSpec(**SPEC, roofline=RooflineParams(30.0, 10.0, 0.1, 0.05))
    kw = dict(spec=spec, max_context=400, max_batch=2, device=torch.device("cuda"), dtype=torch.bfloat16)
    kv = LatentWriteScopeKV(LAYERS, 2 * HS, HS, **kw) if latent else WriteScopeKV(LAYERS, NKV, HS, **kw)
    try:
        params = cost_probe.measure_costs(kv, NH, **SMALL)
        assert 0 < params.A_ns_per_token < 1e6 and 0 < params.B_ns_per_token < 1e6
        assert params.delta_ms == 0.1
    finally:
        kv.close()


def test_a_probe_that_fails_leaves_the_defaults_and_the_backend_usable(monkeypatch, capsys):
    def fail(kv, n_heads):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(kv_setup, "measure_costs", fail)
    kv = make()
    kv.transport.cuda = True  # a GPU's choice, on this machine's CPU tensors
    try:
        kv_setup._start_costs(kv, None, _Args, torch.float32, 2)
        assert kv.costs_from == "defaults" and kv.telemetry()["A_ns_per_token"] == 30.0
        assert "could not be measured at setup" in capsys.readouterr().err
    finally:
        kv.transport.cuda = False
        kv.close()
