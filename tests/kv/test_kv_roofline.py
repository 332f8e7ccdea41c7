"""The roofline share r(L) (Eq. 2), the online cost estimators and marginal-share routing."""

import pytest

from engine.sched.roofline import (
    CostTracker,
    RooflineParams,
    SharePolicy,
    parse_share,
    route_to_cpu,
    split_run,
    target_share,
)


@pytest.mark.parametrize("A,B,delta,L", [(200, 40, 0.1, 32768), (100, 100, -0.2, 4096), (50, 80, 0.0, 1000),
                                         (10, 1000, 0.5, 2048), (1000, 10, -1.0, 512)])
def test_target_share_is_equation_2(A, B, delta, L):
    r = target_share(A, B, delta, L)
    expected = min(1.0, max(0.0, B / (A + B) + delta * 1e6 / ((A + B) * L)))
    assert r == pytest.approx(expected)
    if 0 < r < 1:  # both engines finish together: r·A·L + C_CPU = (1 − r)·B·L + C_GPU
        assert r * A * L == pytest.approx((1 - r) * B * L + delta * 1e6)


def test_share_converges_to_b_over_a_plus_b_and_clamps():
    assert target_share(200, 50, 0.3, 10**12) == pytest.approx(0.2, abs=1e-6)
    assert target_share(200, 50, 100.0, 10) == 1.0
    assert target_share(200, 50, -100.0, 10) == 0.0


def test_cost_tracker_back_computes_the_per_token_cost_over_a_sliding_window():
    t = CostTracker(per_token_ns=999, fixed_ms=0.05, window=8)
    assert t.per_token_ns == 999  # no sample yet: the calibrated value
    for tokens in (1000, 2000, 4000, 8000):
        t.observe(tokens, (tokens * 150 + 50_000) / 1e9)  # 150 ns/token + 0.05 ms fixed
    assert t.per_token_ns == pytest.approx(150)
    for _ in range(8):  # the workload changes (contention): the window forgets the old samples
        t.observe(3000, (3000 * 400 + 50_000) / 1e9)
    assert t.per_token_ns == pytest.approx(400)


def test_policies_and_their_shares():
    p = RooflineParams(A_ns_per_token=300, B_ns_per_token=100, delta_ms=0.0)
    assert SharePolicy.from_name("writescope", p).target(10**6) == pytest.approx(0.25)
    assert SharePolicy.from_name("gpu-centric", p).target(100) == 0.0
    assert SharePolicy.from_name("cpu-centric", p).target(100) == 1.0
    assert SharePolicy.from_name("fixed:0.3", p).target(100) == 0.3
    assert parse_share("writescope") is None
    with pytest.raises(ValueError):
        parse_share("fixed:1.5")
    live = SharePolicy.from_name("writescope", p)
    for _ in range(10):  # the CPU turns out three times slower than calibrated
        live.A.observe(1000, (1000 * 900 + 50_000) / 1e9)
    assert live.target(10**6) == pytest.approx(100 / 1000, rel=1e-3)


@pytest.mark.parametrize("r", [0.0, 0.15, 0.5, 0.62, 1.0])
def test_marginal_share_routing_follows_the_target_batch_by_batch(r):
    D, cpu, placed = 256, 0, 0
    for i in range(200):
        if route_to_cpu(cpu, placed, D, r):
            cpu += D
        placed += D
        assert abs(cpu / placed - r) <= D / placed / 2 + 1e-9  # within half a batch of the target
    assert split_run(0, 0, 1000, 64, 1.0) == 1000 and split_run(0, 0, 1000, 64, 0.0) == 0
    n = split_run(100, 400, 1024, 64, r)
    assert n % 64 == 0 or n == 1024
    assert abs((100 + n) / 1424 - r) <= 32 / 1424 + 1e-9 or n in (0, 1024)
