"""The expert cost model and the miss planner pick the split their arithmetic implies."""

import pytest

from engine.experts.planner import MissPlanner
from engine.sched.expert_cost import ExpertCostModel

MB = 1_000_000


def costs(**kw) -> ExpertCostModel:
    """1 MB experts, no fixed overheads and a free GPU: only transfer and CPU streaming count.
    pcie 1 GB/s → a fill takes 1 ms; cpu 0.5 GB/s → a CPU expert takes 2 ms when alone."""
    base = dict(expert_bytes=MB, flops_per_token=0.0, pcie_gbps=1.0, host_gbps=100.0, cpu_gbps=0.5,
                cpu_overhead_ms=0.0, gpu_launch_ms=0.0, gpu_gbps=1e9, fill_latency_ms=0.0, attn_ms=0.0)
    base.update(kw)
    return ExpertCostModel(**base)


def brute_force(c: ExpertCostModel, tokens_desc, n_hits, hit_tokens, capacity):
    spans = []
    for q in range(min(len(tokens_desc), capacity) + 1):
        t_gpu, t_cpu = c.layer_ms(n_hits, hit_tokens, tokens_desc[:q], tokens_desc[q:])
        spans.append((max(t_gpu, t_cpu), -q))
    return -min(spans)[1]


def test_residual_bandwidth_is_host_minus_pcie_floored_at_zero():
    assert costs(host_gbps=1.25).residual_gbps == pytest.approx(0.25)
    assert costs(host_gbps=0.8).residual_gbps == 0.0
    assert costs().fill_ms() == pytest.approx(1.0)
    assert costs().cpu_ms(3, 3) == pytest.approx(6.0)


def test_split_balances_fills_and_cpu_when_dram_is_plentiful():
    # B_R = 99 GB/s ≥ the CPU's own 0.5: fills do not slow the CPU. T_G = q, T_C = 2·(6 − q) → q = 4.
    c = costs()
    q, t_gpu, t_cpu = c.best_split([1] * 6, 0, 0, capacity=10)
    assert (q, t_gpu, t_cpu) == (4, pytest.approx(4.0), pytest.approx(4.0))


def test_contention_shifts_the_split_towards_fills():
    # B_H = 1.25 → B_R = 0.25 GB/s: a CPU expert beside fills takes 4 ms. q=4: T_C = 4 + (2 MB − 1 MB)/0.5 = 6;
    # q=5: the last CPU MB streams at 0.25 within the 5 ms of fills → T_C = 4, makespan 5 → q = 5.
    c = costs(host_gbps=1.25)
    q, t_gpu, t_cpu = c.best_split([1] * 6, 0, 0, capacity=10)
    assert q == 5 and t_gpu == pytest.approx(5.0) and t_cpu == pytest.approx(4.0)


def test_no_residual_bandwidth_means_the_cpu_waits_for_the_fills():
    # B_H = B_P: B_R = 0. The CPU starts after the fills; T_C(q) = q + 2(6 − q) > T_G(q) = q unless q = 6.
    c = costs(host_gbps=1.0)
    assert c.cpu_ms(2, 2, fills_ms=4.0) == pytest.approx(8.0)
    assert c.best_split([1] * 6, 0, 0, capacity=10)[0] == 6


def test_split_matches_brute_force_over_random_cases():
    import random

    rng = random.Random(0)
    for _ in range(200):
        c = costs(host_gbps=rng.uniform(0.5, 3.0), cpu_gbps=rng.uniform(0.2, 2.0), pcie_gbps=rng.uniform(0.5, 2.0),
                  flops_per_token=rng.choice([0.0, 1e6]), cpu_tflops=0.01, gpu_launch_ms=rng.uniform(0, 0.5),
                  cpu_overhead_ms=rng.uniform(0, 0.5), fill_latency_ms=rng.uniform(0, 0.2),
                  cpu_correction=rng.uniform(0.5, 2.0))
        tokens = sorted((rng.randint(1, 60) for _ in range(rng.randint(0, 9))), reverse=True)
        n_hits = rng.randint(0, 4)
        cap = rng.randint(0, 10)
        q, t_gpu, t_cpu = c.best_split(tokens, n_hits, n_hits * 3, cap)
        assert q == brute_force(c, tokens, n_hits, n_hits * 3, cap)
        # the split's inlined arithmetic is the model's: the same two times as layer_ms
        assert (t_gpu, t_cpu) == pytest.approx(c.layer_ms(n_hits, n_hits * 3, tokens[:q], tokens[q:]), rel=1e-12)


def test_capacity_caps_the_fills():
    assert costs().best_split([1] * 6, 0, 0, capacity=2)[0] == 2
    assert costs().best_split([1] * 6, 0, 0, capacity=0)[0] == 0


def test_decode_makes_no_transfer_that_cannot_pay_back():
    # A fill (10 ms) costs more than computing the expert on the CPU (2 ms): a decode step fills nothing.
    plan = MissPlanner("adaptive", costs(pcie_gbps=0.1), max_decode_tokens=4).plan(
        1, [3, 5], [1, 1], n_hits=1, hit_tokens=1, capacity=8)
    assert plan.phase == "decode" and plan.fill == [] and plan.cpu == [3, 5]


def test_prefill_sends_token_heavy_experts_to_the_gpu_and_cold_ones_to_the_cpu():
    # Per-token CPU compute makes heavy experts expensive on the CPU; the GPU does tokens for free.
    c = costs(flops_per_token=1e6, cpu_tflops=0.001)  # 1 ms per token on the CPU
    plan = MissPlanner("adaptive", c, max_decode_tokens=4).plan(
        240, [0, 1, 2, 3, 4, 5], [2, 90, 1, 40, 3, 104], n_hits=0, hit_tokens=0, capacity=64)
    assert plan.phase == "prefill"
    assert plan.fill[:3] == [5, 1, 3]  # hottest first
    assert set(plan.cpu) <= {0, 2, 4} and plan.cpu  # only cold experts stay on the CPU
    ranked_cpu_tokens = {0: 2, 2: 1, 4: 3}
    assert max(ranked_cpu_tokens[e] for e in plan.cpu) <= min([2, 90, 1, 40, 3, 104][e] for e in plan.fill)


def test_policies():
    c = costs()
    misses, tokens = [7, 2, 9], [1, 3, 1]
    ondemand = MissPlanner("on-demand", c, 4).plan(2, misses, tokens, 0, 0, capacity=8)
    assert ondemand.fill == [2, 7, 9] and ondemand.cpu == [] and ondemand.prefetch == 0
    overflow = MissPlanner("on-demand", c, 4).plan(2, misses, tokens, 1, 1, capacity=1)
    assert overflow.fill == [2] and overflow.cpu == [7, 9]  # a cache too small for the layer: rest on the CPU
    for policy in ("static", "cpu-only"):
        p = MissPlanner(policy, c, 4).plan(2, misses, tokens, 0, 0, capacity=8)
        assert p.fill == [] and p.cpu == [2, 7, 9] and p.prefetch == 0
    with pytest.raises(ValueError):
        MissPlanner("resident", c, 4)


def test_prefetch_depth_follows_idle_link_time_and_confidence():
    c = costs()  # t_io = 1 ms
    assert c.prefetch_depth(2.0, 0.5, aggressive=False) == 2
    assert c.prefetch_depth(2.5, 0.9, aggressive=False) == 3  # ξ = 0.9·0.5 − 0.1·0.5 > 0
    assert c.prefetch_depth(2.5, 0.3, aggressive=False) == 2  # ξ = 0.3·0.5 − 0.7·0.5 < 0
    assert c.prefetch_depth(2.5, 0.0, aggressive=True) == 3  # prefill: aggressive
    assert c.prefetch_depth(0.0, 1.0, aggressive=True) == 0
    # the planner's window: the layer's makespan after its own fills, plus the next attention
    plan = MissPlanner("adaptive", costs(attn_ms=0.5), 4).plan(1, [1, 2, 3], [1, 1, 1], 0, 0, capacity=8)
    t_fill = c.fills_ms(len(plan.fill))
    assert plan.prefetch == c.prefetch_depth(max(plan.t_gpu_ms, plan.t_cpu_ms) - t_fill + 0.5, 0.5, False)


def test_bad_constants_are_refused():
    with pytest.raises(ValueError, match="pcie_gbps"):
        costs(pcie_gbps=0.0)
    with pytest.raises(ValueError, match="attn_ms"):
        costs(attn_ms=-1.0)


def test_defaults_reproduce_the_measured_qwen3_expert_costs():
    c = ExpertCostModel.from_shape(2048, 768, 2)  # Qwen3-30B-A3B expert, bf16: 9.4 MB
    assert c.expert_bytes == 9_437_184
    assert c.fill_ms() == pytest.approx(0.179, abs=0.002)  # NOTES: PCIe fill 0.179 ms
    assert c.cpu_ms(1, 1) - c.cpu_overhead_ms == pytest.approx(0.30, abs=0.02)  # CPU 0.26–0.33 ms
    assert c.cpu_ms(1, 256) - c.cpu_overhead_ms == pytest.approx(1.05, abs=0.2)  # 1.05 ms at 256 tokens
    beside = c.cpu_ms(1, 1, fills_ms=10.0) - c.cpu_overhead_ms
    assert beside == pytest.approx(0.41, abs=0.02)  # ×1.4 beside a saturating fill (measured 0.41 ms)
