"""OffloadedExperts on random inputs against resident execution, for every policy and cache size.

Runs in simulated mode (the "GPU" is the CPU) here and on the GPU where CUDA exists.
"""

import math

import numpy as np
import pytest
import torch

from engine.experts.offload import OFFLOAD_POLICIES, OffloadedExperts
from engine.experts.store import ExpertStore
from engine.kernels import experts_gpu
from engine.kernels.experts_torch import expert_ffn, moe_experts
from engine.models.moe_ffn import softmax_topk
from offload_helpers import DEVICES, QWEN3_COSTS, E, H, I, K, L, forward_passes, make, tiny_experts

model = pytest.fixture(scope="module", name="model")(tiny_experts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", OFFLOAD_POLICIES)
@pytest.mark.parametrize("n_slots", [1, 2, 7, L * E])
def test_outputs_equal_resident(model, policy, n_slots, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ex = make(policy, model, n_slots, device)
    forward_passes(ex, model, device, n_passes=3, n_tokens=24, seed=1)  # prefill-sized steps
    forward_passes(ex, model, device, n_passes=6, n_tokens=3, seed=2)  # decode-sized steps
    t = ex.telemetry()
    lookups = t["hits"] + t["misses"]
    assert lookups > 0 and t["misses"] == t["fills"] + t["cpu_executed"]
    if policy == "cpu-only":
        assert t["slots"] == 0 and t["hits"] == 0 and t["fills"] == 0 and t["cache_bytes"] == 0
    if policy == "static":
        assert t["fills"] == 0 and t["evictions"] == 0
        assert t["hits"] > 0  # the warmed experts serve hits
    if policy == "on-demand" and n_slots >= E:
        assert t["cpu_executed"] == 0  # every miss is filled when the slots can hold a layer
    if n_slots == L * E and policy != "cpu-only":
        assert t["misses"] == 0 and t["hit_rate"] == 1.0  # warmed with everything
    assert t["h2d_bytes"] == (t["fills"] + t["prefetch_issued"] + min(n_slots, L * E) * (policy != "cpu-only")) \
        * ex.store.block_bytes
    ex.close()


def test_adaptive_uses_both_sides_and_prefetches(model):
    # 12 of 18 experts cached: more than one pass uses, so some entries go stale and make room
    ex = make("adaptive", model, 12)
    forward_passes(ex, model, "cpu", n_passes=8, n_tokens=2, seed=3)
    t = ex.telemetry()
    assert t["fills"] > 0 and t["cpu_executed"] > 0 and t["hits"] > 0 and t["evictions"] > 0
    assert t["prefetch_issued"] > 0 and t["prefetch_used"] > 0
    assert t["prefetch_used"] + t["prefetch_wasted"] <= t["prefetch_issued"]
    acc = t["predictor"]
    assert acc["scored_layers"] == 8 * (L - 1)
    assert 0.0 <= acc["token_accuracy"] <= 1.0 and 0.0 <= acc["set_recall"] <= 1.0
    ex.close()


def test_no_slot_allocation_during_decode(model):
    ex = make("adaptive", model, 5)
    pool_ptr, map_ptr = ex.cache.pool.data_ptr(), ex.gpu_set.map_dev.data_ptr()
    forward_passes(ex, model, "cpu", n_passes=10, n_tokens=1, seed=4)
    assert ex.cache.pool.data_ptr() == pool_ptr and ex.gpu_set.map_dev.data_ptr() == map_ptr
    assert ex.cache.allocations == 1 and ex.telemetry()["fills"] > 0
    with pytest.raises(RuntimeError, match="allocated already"):
        ex.open_cache(5)
    ex.close()


def test_cold_cache_and_one_slot_without_warmup(model):
    ex = make("on-demand", model, 1, warm=False)
    forward_passes(ex, model, "cpu", n_passes=2, n_tokens=4, seed=5)
    t = ex.telemetry()
    assert t["fills"] > 0 and t["cpu_executed"] > 0 and t["hot_table"] is None
    ex.close()


def test_group_loop_equals_grouped_mm_and_plain_mm():
    """The loop over host-known groups and torch._grouped_mm (where this torch has it for the CPU)
    compute the same grouped SwiGLU as per-expert F.linear."""
    g = torch.Generator().manual_seed(7)
    pool = torch.randn(5, 3 * H * I, generator=g)  # (slots, P)
    gate_up = pool[:, :2 * I * H].unflatten(1, (2 * I, H))
    down = pool[:, 2 * I * H:].unflatten(1, (H, I))
    xs = torch.randn(9, H, generator=g)
    offs = torch.tensor([2, 2, 2, 7, 8], dtype=torch.int32)  # slot 0: rows 0-1, 3: rows 2-6, 4: row 7; row 8 spare
    groups = [(0, 0, 2), (3, 2, 7), (4, 7, 8)]
    assert experts_gpu.groups_of(offs) == groups
    looped = experts_gpu.grouped_expert_ffn(xs, gate_up, down, offs, groups)
    for slot, a, b in groups:
        torch.testing.assert_close(looped[a:b], expert_ffn(xs[a:b], gate_up[slot], down[slot]))
    assert torch.equal(looped[8], torch.zeros(H))
    assert experts_gpu.grouped_impl(torch.device("cpu"), torch.float32) == "group-loop"
    if experts_gpu._probe(torch.device("cpu"), torch.float32):  # torch's own CPU kernel, where present
        h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
        a, b = h.chunk(2, dim=-1)
        mm = torch._grouped_mm(torch.nn.functional.silu(a) * b, down.transpose(1, 2), offs=offs)
        torch.testing.assert_close(mm[:8], looped[:8], atol=1e-5, rtol=1e-5)


def test_cpu_kernel_is_injectable(model):
    calls = []

    def counting_ffn(x, gate_up, down):
        calls.append(x.shape[0])
        return expert_ffn(x, gate_up, down)

    gate_up, down, _ = model
    store = ExpertStore.from_layers(gate_up, down, dtype=torch.float32)
    ex = OffloadedExperts("cpu-only", store, device=torch.device("cpu"), n_slots=0, cpu_ffn=counting_ffn,
                          cpu_kernel="counting")
    x = torch.randn(4, H)
    w, ids = softmax_topk(torch.randn(4, E), K, True)
    torch.testing.assert_close(ex.run(0, x, ids, w), moe_experts(x, ids, w, gate_up[0], down[0]))
    assert sum(calls) == 4 * K and ex.telemetry()["cpu_kernel"] == "counting"
    assert np.isclose(ex.telemetry()["cpu_expert_s"], ex.cpu_s)
    ex.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["adaptive", "on-demand"])
def test_cuda_bf16_grouped_path_matches_resident(model, policy):
    """The engine dtype on a GPU: one torch._grouped_mm per matmul over the slot pool."""
    gate_up, down, routers = model
    store = ExpertStore.from_layers(gate_up, down, dtype=torch.bfloat16, pin=True)
    ex = OffloadedExperts(policy, store, device=torch.device("cuda"), n_slots=7, costs=QWEN3_COSTS)
    assert ex.telemetry()["gpu_kernel"] == "grouped_mm"
    g = torch.Generator().manual_seed(6)
    for step in range(6):
        for layer in range(L):
            x = torch.randn(3 if step else 24, H, generator=g).to("cuda", torch.bfloat16)
            w, ids = softmax_topk(x.float() @ routers[layer].T.cuda(), K, True)
            w = w.to(torch.bfloat16)
            ref = moe_experts(x, ids, w, gate_up[layer].cuda().bfloat16(), down[layer].cuda().bfloat16())
            torch.testing.assert_close(ex.run(layer, x, ids, w), ref, atol=3e-2, rtol=3e-2)
    assert ex.telemetry()["fills"] > 0
    ex.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_gemm_over_more_slots_than_one_call_takes():
    """A 24 GB slot pool has ~2,000 slots; torch._grouped_mm takes ≤1024 groups per call."""
    from engine.kernels.experts_gpu import MAX_GROUPS, _loop_linear, grouped_expert_ffn, groups_of

    gen = torch.Generator(device="cuda").manual_seed(0)
    G, H, I = MAX_GROUPS + 300, 64, 32
    gate_up = torch.randn(G, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
    down = torch.randn(G, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
    used = torch.tensor([3, 500, MAX_GROUPS - 1, MAX_GROUPS, G - 1], device="cuda")  # both windows
    counts = torch.zeros(G, dtype=torch.int64, device="cuda")
    counts[used] = torch.tensor([2, 1, 3, 1, 2], device="cuda")
    offs = counts.cumsum(0).to(torch.int32)
    xs = torch.randn(int(counts.sum()), H, device="cuda", dtype=torch.bfloat16, generator=gen)
    got = grouped_expert_ffn(xs, gate_up, down, offs).float()
    groups = groups_of(offs)
    gate, up = _loop_linear(xs, gate_up, groups).chunk(2, dim=-1)
    ref = _loop_linear(torch.nn.functional.silu(gate) * up, down, groups).float()
    assert ((got - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resident_grouped_experts_match_the_reference_loop():
    from engine.experts.executor import ResidentExperts
    from engine.kernels.experts_torch import moe_experts

    gen = torch.Generator(device="cuda").manual_seed(1)
    E, H, I, N, k = 128, 256, 96, 37, 8
    gate_up = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
    down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(N)])  # (N, k)
    weights = torch.softmax(torch.randn(N, k, device="cuda", generator=gen), -1).to(torch.bfloat16)
    got = ResidentExperts([gate_up], [down]).run(0, x, ids, weights).float()
    ref = moe_experts(x.float(), ids, weights.float(), gate_up.float(), down.float())
    assert ((got - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("policy", ["cpu-only", "adaptive"])
def test_native_cpu_sets_run_on_the_native_worker_and_equal_resident(policy):
    """Experts the native kernel takes (bf16, H and I multiples of 16) go to the CPU as one call built
    from the store's block addresses and run on the native worker thread; outputs equal resident
    execution, and the worker's queue and compute time are reported."""
    from engine.kernels import native

    if native.module() is None:
        pytest.skip("needs the native extension")
    Lb, Eb, Hb, Ib = 2, 8, 64, 32
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    gate_up = [(torch.randn(Eb, 2 * Ib, Hb, generator=g) / Hb**0.5).bfloat16() for _ in range(Lb)]
    down = [(torch.randn(Eb, Hb, Ib, generator=g) / Ib**0.5).bfloat16() for _ in range(Lb)]
    routers = [torch.randn(Eb, Hb, generator=g) for _ in range(Lb)]
    store = ExpertStore.from_layers(gate_up, down, dtype=torch.bfloat16)
    ex = OffloadedExperts(policy, store, device=torch.device("cpu"), n_slots=3, max_decode_tokens=4, costs=QWEN3_COSTS)
    assert not ex._cpu_runner.native  # no thread before the first CPU set
    for _ in range(3):
        x = torch.randn(4, Hb, generator=g).bfloat16()
        for layer in range(Lb):
            w, ids = softmax_topk(x.float() @ routers[layer].T, K, True)
            out = ex.run(layer, x, ids, w.bfloat16())
            ref = moe_experts(x.float(), ids, w, gate_up[layer].float(), down[layer].float())
            torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    tel = ex.telemetry()
    assert tel["cpu_executed"] > 0 and tel["cpu_expert_s"] > 0 and tel["cpu_queue_s"] >= 0
    assert ex._cpu_runner.native
    ex.close()


@pytest.mark.parametrize("policy", OFFLOAD_POLICIES)
def test_host_half_then_gpu_side_equals_the_whole_run(model, policy):
    """Graph pieces split a decode layer: `run(..., cpu_buf=)` places the experts, publishes the slot
    map, calls `between` (where the captured `gpu_side` is launched, before the CPU set is waited for)
    and leaves the CPU set's sum in cpu_buf. The slots' part computed in `between` plus cpu_buf equals
    resident execution, with fills, evictions and CPU sets (4 slots)."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # gpu_side's kernels: compiled, or interpreted
    gate_up, down, routers = model
    ex = make(policy, model, 4, device)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(3, H, generator=g)
        for layer in range(L):
            w, ids = softmax_topk(x @ routers[layer].T, K, True)
            xd, idsd, wd = x.to(device), ids.to(device), w.to(device)
            cpu_buf = torch.full((3, H), float("nan"), device=device)
            on_slots = []
            assert ex.run(layer, xd, idsd, wd, cpu_buf=cpu_buf,
                          between=lambda: on_slots.append(ex.gpu_side(layer, xd, idsd, wd))) is None
            assert len(on_slots) == 1 and (on_slots[0] is None) == (policy == "cpu-only")
            out = cpu_buf.to(xd.dtype) if on_slots[0] is None else on_slots[0] + cpu_buf.to(xd.dtype)
            torch.testing.assert_close(out.cpu(), moe_experts(x, ids, w, gate_up[layer], down[layer]),
                                       atol=2e-5, rtol=1e-5)
            x = x + 0.3 * torch.randn(3, H, generator=g)
    t = ex.telemetry()
    assert t["misses"] == t["fills"] + t["cpu_executed"] and t["hits"] + t["misses"] > 0


def test_stats_say_why_the_whole_step_graph_is_off(model):
    """Every offload policy on CUDA (with a pinned store) decodes through one graph; elsewhere the
    stats give the reason."""
    assert make("on-demand", model, 4).telemetry()["zero_copy"] == {"off": "needs CUDA and Triton"}
    assert make("static", model, 4).telemetry()["zero_copy"] == {"off": "needs CUDA and Triton"}
    assert make("adaptive", model, 4).telemetry()["zero_copy"] == {"off": "needs CUDA and Triton"}
    if torch.cuda.is_available():
        tel = make("adaptive", model, 4, "cuda").telemetry()["zero_copy"]
        assert tel["graph_steps"] == 0 and tel["zero_copy_experts"] == 0


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_routed_cpu_set_equals_the_numpy_built_one_bit_for_bit(w_dtype):
    """A decode layer's CPU set handed over as the routing (`routed_cpu_set`: grouped in C++ by the
    extension) computes exactly what the table built with numpy (`native_cpu_set`) computes, for any
    routing, any subset of its experts and routing weights in every dtype."""
    from engine.experts.cpu_set import native_cpu_set, routed_cpu_set
    from engine.kernels import experts_cpu, native

    if native.module() is None:
        pytest.skip("needs the native extension")
    Lb, Eb, Hb, Ib, Kb = 2, 16, 64, 32, 4
    seed = int(torch.randint(0, 2**31, ()))
    g, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    store = ExpertStore.empty(Lb, [0, 1], Eb, Hb, Ib, torch.bfloat16)
    store.blocks.normal_(generator=g)
    worker = experts_cpu.MoeWorker.create()
    for N in (1, 3, 4, 8):
        for layer in range(Lb):
            ids = np.stack([rng.choice(Eb, Kb, replace=False) for _ in range(N)]).astype(np.int64)  # (N, K)
            active = np.unique(ids)
            chosen = rng.permutation(active)[:max(1, len(active) // 2)].tolist()  # any order
            w = torch.softmax(torch.randn(N, Kb, generator=g), -1).to(w_dtype)
            x = torch.randn(N, Hb, generator=g).bfloat16()
            want = native_cpu_set(store, layer, chosen, ids, w, x, torch.full((N, Hb), math.nan))
            routed = routed_cpu_set(store, layer, chosen, ids, w, x, torch.full((N, Hb), math.nan))
            assert routed is not None and routed.one_native_call
            for prepared in (want, routed):
                worker.submit(prepared)
                worker.wait()
            assert torch.equal(routed.out, want.out)
    worker.close()


def test_routed_cpu_set_refuses_what_it_cannot_index():
    """Experts out of range, twice, or not in the store, and routing ids out of range are refused
    with clear errors before anything runs, and the worker stays usable; more tokens than the native
    kernel takes leaves the set to the other paths (None)."""
    from engine.experts.cpu_set import routed_cpu_set
    from engine.kernels import experts_cpu, native

    if native.module() is None:
        pytest.skip("needs the native extension")
    Eb, Hb, Ib = 8, 64, 32
    store = ExpertStore.empty(3, [0, 2], Eb, Hb, Ib, torch.bfloat16)  # layer 1 has no routed experts
    store.blocks.normal_()
    worker = experts_cpu.MoeWorker.create()
    ids = np.array([[0, 1], [2, 1]], dtype=np.int64)
    x, w = torch.randn(2, Hb).bfloat16(), torch.full((2, 2), 0.5)

    def submit(layer, chosen, ids):
        worker.submit(routed_cpu_set(store, layer, chosen, ids, w, x, torch.empty(2, Hb)))

    for layer, chosen, bad_ids, match in ((0, [8], ids, "chosen expert is out of range"),
                                          (0, [1, 1], ids, "distinct"),
                                          (1, [1], ids, "no weights in the store"),
                                          (0, [1], np.array([[0, 9], [2, 1]]), "routed expert id is out of range")):
        with pytest.raises(ValueError, match=match):
            submit(layer, chosen, bad_ids)
    submit(2, [2], ids)
    with pytest.raises(RuntimeError, match="not been collected"):
        submit(2, [2], ids)
    out, _, _ = worker.wait()
    assert out[0].eq(0).all() and out[1].abs().sum() > 0  # only token 1 chose expert 2
    many = experts_cpu.native_max_tokens() + 1
    assert routed_cpu_set(store, 0, [0], np.zeros((many, 2), dtype=np.int64), torch.ones(many, 2),
                          torch.randn(many, Hb).bfloat16(), torch.empty(many, Hb)) is None
    worker.close()
