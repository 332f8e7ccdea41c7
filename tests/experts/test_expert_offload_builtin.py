"""Expert offloading on the built-in MoE model, simulated on the CPU: every policy and cache size
generates exactly what resident execution generates; stats and prediction accuracy are reported.

One engine is loaded; the policies are swapped in as executors over its store (the store is
immutable and shared), so the file stays fast.
"""

from types import SimpleNamespace

import pytest
import torch

from engine.api import Engine, EngineConfig, GenerationRequest
from engine.errors import ConfigError
from engine.experts.executor import ResidentExperts
from engine.experts.offload import OffloadedExperts
from engine.experts.predictor import HotTable
from engine.runtime.expert_placement import switch_expert_policy

MODEL = "builtin:smollm2-135m-moe"
PROMPT = "The capital of France is"  # raw text, no template: a short prefill keeps the file fast
N_NEW = 6


@pytest.fixture(scope="module")
def engine():
    eng = Engine(EngineConfig(model=MODEL, backend="tandem", device="cpu", expert_policy="adaptive",
                              simulate_hybrid=True, expert_cache_slots=40, max_context=256, max_batch=2))
    yield eng
    eng.close()


def use(engine, executor) -> None:
    parts = engine.backend.parts
    for layer in parts.model.model.layers:
        layer.mlp.experts = executor
    parts.experts = executor


def switch(engine, policy: str, slots: int) -> OffloadedExperts:
    config = SimpleNamespace(expert_cache_slots=slots, vram_budget_gb=None, model=MODEL)
    return switch_expert_policy(engine.backend.parts, config, policy)


@pytest.fixture(scope="module")
def reference(engine):
    """Resident execution over the same weights: the upcycled experts of a layer share one store
    block, so a stride-0 expansion of it is the layer's resident (E, 2I, H) / (E, H, I) tensors."""
    parts = engine.backend.parts
    adaptive = parts.experts
    store = adaptive.store
    E = store.n_experts
    assert all(len(set(store.block_of[l].tolist())) == 1 for l in store.layers)
    gate_up = [store.expert(l, 0)[0].unsqueeze(0).expand(E, -1, -1) for l in store.layers]
    down = [store.expert(l, 0)[1].unsqueeze(0).expand(E, -1, -1) for l in store.layers]
    use(engine, ResidentExperts(gate_up, down))
    ids = engine.tokenize(PROMPT)
    tokens = engine.generate_ids(ids, N_NEW)
    use(engine, adaptive)
    return ids, tokens


def test_adaptive_generates_what_resident_generates(engine, reference):
    ids, tokens = reference
    ex = engine.backend.parts.experts
    pool = ex.cache.pool.data_ptr()
    assert engine.generate_ids(ids, N_NEW) == tokens
    t = ex.telemetry()
    assert t["fills"] > 0 and t["cpu_executed"] > 0 and t["hits"] > 0 and t["evictions"] > 0
    assert ex.cache.pool.data_ptr() == pool and ex.cache.allocations == 1  # no slot allocation
    acc = t["predictor"]
    print(f"\ngate-lookahead prediction on {MODEL}: token accuracy {acc['token_accuracy']:.3f}, "
          f"set recall {acc['set_recall']:.3f}, set precision {acc['set_precision']:.3f} "
          f"over {acc['scored_layers']} layer steps (chance: 0.25)")
    assert acc["scored_layers"] > 0 and acc["token_accuracy"] > 0.25  # better than choosing at random


@pytest.mark.parametrize("policy,slots", [("adaptive", 1), ("adaptive", 7), ("on-demand", 1), ("static", 40),
                                          ("cpu-only", 0)])
def test_every_policy_and_cache_size_generates_what_resident_generates(engine, reference, policy, slots):
    ids, tokens = reference
    ex = switch(engine, policy, slots)
    try:
        assert engine.info()["expert_policy"] == policy
        assert engine.generate_ids(ids, N_NEW) == tokens
        t = ex.telemetry()
        assert t["policy"] == policy and t["slots"] == slots
        assert t["misses"] == t["fills"] + t["cpu_executed"]
        if policy == "cpu-only":
            assert t["hits"] == 0 and t["cpu_executed"] > 0
        if policy == "static":
            assert t["fills"] == 0 and t["hits"] > 0
        if policy == "on-demand" and slots > 8:
            assert t["cpu_executed"] == 0
    finally:
        switch(engine, "adaptive", 40)


def test_batched_decode_equals_solo_runs(engine, reference):
    ids, tokens = reference
    other = engine.tokenize("Roses are red, violets are")
    solo = engine.generate_ids(other, N_NEW)
    reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=N_NEW, greedy=True) for p in (ids, other)]
    batch = engine.generate_batch(reqs)
    assert [r.token_ids for r in batch] == [tokens, solo]


def test_stats_snapshot_carries_expert_counters(engine, reference):
    engine.generate_ids(reference[0], 3)
    data = engine.stats().to_dict()
    ex = engine.backend.parts.experts
    experts = data["experts"]
    assert experts["policy"] == "adaptive" and experts["slots"] == 40
    for key in ("hits", "misses", "fills", "cpu_executed", "evictions", "prefetch_used", "prefetch_wasted",
                "hit_rate", "prefetch_issued", "cpu_expert_s"):
        assert experts[key] is not None, key
    assert 0.0 <= experts["hit_rate"] <= 1.0
    assert data["host"]["expert_store"] == ex.store.nbytes
    assert data["pcie"]["h2d_bytes"] >= ex.h2d_bytes > 0  # expert traffic adds to the KV's
    assert data["kernels"]["cpu_experts"] == ex.cpu_kernel
    assert data["model"]["expert_policy"] == "adaptive"


def test_hot_table_recorded_from_a_trace_warms_the_cache(engine, reference, tmp_path, monkeypatch):
    from engine.bench.experts import record_trace
    from engine.runtime import expert_placement

    path = tmp_path / "hot.json"
    rec = record_trace(engine, [reference[0]], new_tokens=2, path=str(path))
    assert path.is_file() and rec["tokens_routed"] > 0
    table = HotTable.load(path)
    assert table.counts.sum() == rec["tokens_routed"] and table.top(10) == [tuple(t) for t in rec["top10"]]
    monkeypatch.setattr(expert_placement, "default_hot_table_path", lambda model: path)
    try:
        ex = switch(engine, "static", 12)
        assert ex.hot_source == str(path)
        assert set(ex.cache.lru.order()) == set(table.top(12))  # static keeps exactly the hottest
        assert engine.generate_ids(reference[0], N_NEW) == reference[1]
        assert ex.telemetry()["fills"] == 0
    finally:
        switch(engine, "adaptive", 40)


def test_bench_records_every_policy_and_phase(engine, reference):
    from engine.bench.experts import run
    from engine.experts.cpu_mailbox import graph_cpu_enabled

    rec = run(engine=engine, policies=("cpu-only", "adaptive"), batch_sizes=(1, 2), contexts=(8,), new_tokens=3,
              warmup=False)
    assert rec["bench"] == "experts" and rec["simulate_hybrid"] and len(rec["results"]) == 4
    assert rec["graph_cpu"] == graph_cpu_enabled()  # (TANDEM_GRAPH_CPU is not on the command line)
    for row in rec["results"]:
        for phase in ("prefill", "decode"):
            p = row[phase]
            assert p["tok_s"] > 0 and p["tokens"] > 0 and p["hit_rate"] is not None and p["pcie_gbps"] >= 0
        if row["policy"] == "cpu-only":
            assert row["decode"]["hit_rate"] == 0.0 and row["decode"]["cpu_executed"] > 0
        # the driving thread's host work per part, and the CPU sets' queue, as deltas of the phase
        split = row["decode"]["host_split_s"]
        assert "lookup" in split and "merge" in split and all(v >= 0 for v in split.values())
        assert row["decode"]["cpu_queue_s"] >= 0 and sum(split.values()) <= row["decode"]["run_s"] + 1e-3
        assert row["decode"]["tokens"] == 3 * row["batch"]
    assert set(rec["adaptive_vs_best_baseline_decode"]) == {"ctx8-bs1", "ctx8-bs2"}
    assert rec["results"][-1]["predictor"]["scored_layers"] > 0
    assert rec["decode"] == "sample" and not rec["shared_prefill"]
    switch(engine, "adaptive", 40)


def test_bench_shared_prefill_decodes_every_policy_from_one_kv(engine, reference):
    """One prefill per (context, batch) under the first policy; each policy then decodes on from
    that KV, and only the first row carries the prefill."""
    from engine.bench.experts import run

    rec = run(engine=engine, policies=("on-demand", "cpu-only", "adaptive"), batch_sizes=(2,), contexts=(8,),
              new_tokens=3, shared_prefill=True, decode="greedy")
    rows = rec["results"]
    assert [r["policy"] for r in rows] == ["on-demand", "cpu-only", "adaptive"]
    assert rows[0]["prefill"]["tokens"] == 2 * 8 and rows[1]["prefill"] is None and rows[2]["prefill"] is None
    assert all(r["decode"]["tokens"] == 3 * 2 for r in rows)
    assert all(r["decode"]["prefilled"] == 2 for r in rows)  # every policy decoded on from the kept KV
    assert rows[1]["decode"]["cpu_executed"] > 0 and rows[1]["decode"]["hit_rate"] == 0.0
    assert engine.backend.generator.sessions == {}  # the shared sessions end with their rows
    from engine.bench.experts import context_needed

    # the shared sequence: prompt, first token, then per policy a 2-token warm-up and the 3 measured tokens
    assert context_needed((8,), 3, 3, True) >= 8 + 1 + 3 * (2 + 3)
    assert set(rec["adaptive_vs_best_baseline_decode"]) == {"ctx8-bs2"}
    # Rounds: the policies take turns on the same KV; the ratio is the median of the rounds' ratios.
    rec = run(engine=engine, policies=("on-demand", "adaptive"), batch_sizes=(1,), contexts=(8,), new_tokens=2,
              shared_prefill=True, decode="greedy", rounds=3, warmup=False)
    rows = rec["results"]
    assert [(r["policy"], r["round"]) for r in rows] == [(p, k) for k in range(3) for p in ("on-demand", "adaptive")]
    per_round = rec["adaptive_vs_best_baseline_decode_per_round"]["ctx8-bs1"]
    assert len(per_round) == 3 and rec["adaptive_vs_best_baseline_decode"]["ctx8-bs1"] == sorted(per_round)[1]
    assert rows[0]["prefill"] is not None and all(r["prefill"] is None for r in rows[1:])
    with pytest.raises(ValueError, match="shared_prefill"):
        run(engine=engine, policies=("adaptive",), rounds=2)
    with pytest.raises(ValueError, match="sample"):
        run(engine=engine, policies=("adaptive",), decode="beam")
    switch(engine, "adaptive", 40)


def test_offload_needs_a_gpu_or_simulation():
    with pytest.raises(ConfigError, match="splits experts between a GPU and the CPU"):
        Engine(EngineConfig(model=MODEL, backend="tandem", device="cpu", expert_policy="adaptive"))
    with pytest.raises(ConfigError, match="unknown expert_policy"):
        Engine(EngineConfig(model=MODEL, backend="tandem", device="cpu", expert_policy="lru"))


def test_switching_needs_an_offloaded_engine(engine, reference):
    with pytest.raises(ConfigError, match="cannot switch"):
        switch(engine, "resident", 4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["adaptive", "on-demand", "static", "cpu-only"])
def test_cuda_offload_generates_what_resident_generates(policy):
    common = dict(model=MODEL, backend="tandem", device="cuda", dtype="float32", max_context=256, max_batch=2)
    resident = Engine(EngineConfig(**common))
    ids = resident.tokenize(PROMPT)
    want = resident.generate_ids(ids, N_NEW)
    resident.close()
    eng = Engine(EngineConfig(**common, expert_policy=policy, expert_cache_slots=40))
    try:
        assert eng.generate_ids(ids, N_NEW) == want
        assert eng.stats().to_dict()["vram"]["expert_cache"] == eng.backend.parts.experts.telemetry()["cache_bytes"]
    finally:
        eng.close()


def test_bench_experts_from_the_command_line(tmp_path):
    """`tandem bench experts …` parses its flags in engine.bench.experts and writes the record."""
    import json

    from engine.cli import main

    out = tmp_path / "experts.json"
    rc = main(["bench", "experts", "--model", MODEL, "--device", "cpu", "--simulate-hybrid", "--policies",
               "cpu-only,on-demand", "--batch-sizes", "1", "--contexts", "6", "--new-tokens", "2",
               "--expert-cache-slots", "8", "--decode", "greedy", "--shared-prefill", "--json", str(out)])
    rec = json.loads(out.read_text())
    assert rc == 0 and rec["decode"] == "greedy" and rec["shared_prefill"]
    assert [r["policy"] for r in rec["results"]] == ["cpu-only", "on-demand"]
    assert all(r["decode"]["prefilled"] == 1 for r in rec["results"])


def test_an_engine_plans_its_experts_with_the_machines_calibration(tmp_path):
    """The calibrated expert costs reach the offloaded executor's cost model (they used to stop at the
    profile: the planner ran on the defaults)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "hw"))
    from hwcheck import make_profile

    from engine.hw import profile

    path = profile.save(make_profile(), tmp_path / "hw-profile.json")
    eng = Engine(EngineConfig(model=MODEL, backend="tandem", device="cpu", expert_policy="on-demand",
                              simulate_hybrid=True, expert_cache_slots=8, max_context=64, profile_path=str(path)))
    try:
        costs = eng.backend.parts.experts.costs
        assert (costs.pcie_gbps, costs.host_gbps) == (50.0, 70.0)  # B_P, and B_P + the CPU beside fills
        assert costs.zero_copy_gbps == pytest.approx(50.0 * 38.6 / 52.7)  # in-place reads: B_P's share of them
    finally:
        eng.close()
