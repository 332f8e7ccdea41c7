"""The CPU's share of a graph step's misses (engine/experts/cpu_mailbox.py): the device splits a layer's
misses and posts the CPU's part to pinned memory, the native worker answers, the sum kernel waits for
it. On the GPU where CUDA exists, else with the kernels under Triton's interpreter and the same native
worker: the device's split is the best integer one for the costs it is given; outputs equal resident
execution for any split and cache size; the CPU's experts are counted as misses and never fill a slot;
the split's CPU costs follow the worker's measured posts; a worker that does not answer makes the step
fail loudly."""

import time

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from engine.experts.cache import ExpertCache  # noqa: E402
from engine.experts.cpu_mailbox import (LINK_NEVER_MS, MEASURE_POSTS, CpuMailbox, MissSplit, graph_cpu_enabled,  # noqa: E402
                                        worker_threads)
from engine.experts.measured_costs import CPU_CORRECTION_WINDOW, MeasuredCosts  # noqa: E402
from engine.experts.store import ExpertStore  # noqa: E402
from engine.experts.zero_copy import ZeroCopyDecode  # noqa: E402
from engine.kernels import native  # noqa: E402
from engine.kernels.experts_torch import expert_ffn, moe_experts  # noqa: E402
from engine.sched.expert_cost import ExpertCostModel  # noqa: E402

if native.module() is None or not hasattr(native.module(), "CpuMailbox"):
    pytest.skip("the CPU mailbox needs the native extension", allow_module_level=True)

L, E, H, I, K = 3, 6, 32, 16, 2  # the CPU kernels take hidden and inter in multiples of 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (link_ms, cpu_ms, handoff_ms): link and CPU alike, so c = m / 2 rounded down (ties stay on the link);
# the CPU free, so every miss goes there
EVEN, ALL = (1.0, 1.0, 0.0), (1.0, 0.0, 0.0)
NO_LINK = (LINK_NEVER_MS, 0.3, 0.05)  # static and cpu-only: every miss to the CPU, however slow it is
# on a GPU machine these run on CUDA: marked so that `-m cuda` (the lease scripts) selects them
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []


def _split(link_ms, cpu_ms, handoff_ms):
    """A MissSplit whose decode model gives these three costs: a 1 MB expert with no per-token compute,
    read at 1 / link_ms GB/s in place and 1 / cpu_ms GB/s by the CPU (a free CPU: 1 µs an expert)."""
    cpu_gbps = 1.0 / max(cpu_ms, 1e-6)
    costs = ExpertCostModel(expert_bytes=1e6, flops_per_token=0.0, cpu_overhead_ms=handoff_ms, cpu_gbps=cpu_gbps,
                            host_gbps=max(cpu_gbps, 76.0),
                            zero_copy_gbps=1.0 / link_ms if link_ms < LINK_NEVER_MS else 1.0)
    return MissSplit(MeasuredCosts(costs), link=link_ms < LINK_NEVER_MS)


def _store(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = [torch.randn(E, 2 * I, H, generator=g) / H**0.5 for _ in range(L)]
    down = [torch.randn(E, H, I, generator=g) / I**0.5 for _ in range(L)]
    store = ExpertStore.from_layers(gate_up, down, dtype=torch.float32, pin=DEVICE == "cuda")
    return store, gate_up, down


def _wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "the worker did not answer"
        time.sleep(0.001)


def test_the_device_sends_the_first_missed_experts_to_the_cpu_and_the_worker_answers():
    """Two tokens, top-2: expert 1 is cached, 3 and 5 are not. With link and CPU costing alike one of
    the two missed experts goes: the first in pair order, 3 (both of its pairs); the worker's sum is
    expert 3's weighted output for each token."""
    store, gate_up, down = _store()
    box = CpuMailbox(store, torch.device(DEVICE), max_rows=4, top_k=K, split=EVEN)
    try:
        offsets = torch.full((E,), 10**12, dtype=torch.int64)  # outside any pool: read from the store
        offsets[1] = 0  # in the pool (the pool's size below is 100 elements)
        ids = torch.tensor([[3, 1], [3, 5]])
        x = torch.randn(2, H)
        w = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
        gpu_ids = torch.empty(4, dtype=torch.int64, device=DEVICE)
        log, cpu_log = torch.empty_like(gpu_ids), torch.empty_like(gpu_ids)
        out_ids = box.post(0, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), offsets.to(DEVICE), 100, gpu_ids, log,
                           cpu_log)
        assert out_ids.cpu().tolist() == [[-1, 1], [-1, 5]]
        assert log.cpu().tolist() == [3, 1, 3, 5] and cpu_log.cpu().tolist() == [1, 0, 1, 0]
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        assert int(box.expect.cpu()) == 1 == int(box.seq.cpu())
        _wait_for(lambda: int(box.done[0]) == 1)
        want = torch.stack([w[t, 0] * expert_ffn(x[t:t + 1].double(), gate_up[0][3].double(),
                                                       down[0][3].double())[0] for t in range(2)])
        torch.testing.assert_close(box.out[:2].double(), want, atol=1e-5, rtol=1e-4)
        assert box.telemetry()["experts"] == 1 and box.telemetry()["posts"] == 1
        # one missed expert: the CPU would take as long as the link, so it stays there (and fills a
        # slot); nothing is posted, and the sum waits for nothing
        offsets[3] = 0
        out_ids = box.post(1, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), offsets.to(DEVICE), 100, gpu_ids, log,
                           cpu_log)
        assert out_ids.cpu().tolist() == ids.tolist() and cpu_log.cpu().tolist() == [0] * 4
        assert int(box.expect.cpu()) == 0 and int(box.seq.cpu()) == 1
        # with the CPU free every miss goes: the next post is number 2
        box.set_split(ALL)
        box.post(2, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), offsets.to(DEVICE), 100, gpu_ids, log, cpu_log)
        assert cpu_log.cpu().tolist() == [0, 0, 0, 1] and int(box.expect.cpu()) == 2
        _wait_for(lambda: int(box.done[0]) == 2)
    finally:
        box.close()


def _decode(n_slots, split, steps=8, n_tokens=2, seed=1, same_routing=False):
    store, gate_up, down = _store()
    cache = ExpertCache(n_slots, H, I, torch.float32, torch.device(DEVICE))
    zc = ZeroCopyDecode(store, cache, torch.device(DEVICE), max_tokens=4, lag_list_share=1.0,
                        cpu_split=_split(*split))
    g = torch.Generator().manual_seed(seed)
    lookups = 0
    try:
        for step in range(steps):
            zc.before_step()
            for layer in range(L):
                x = torch.randn(n_tokens, H, generator=g)
                # a few popular experts, and now and then anything, so that the cache has something to learn
                ids = torch.tensor([[0, 1]] * n_tokens) if same_routing else \
                    torch.stack([torch.randperm(3 if step % 4 else E, generator=g)[:K] for _ in range(n_tokens)])
                w = torch.softmax(torch.randn(n_tokens, K, generator=g), -1)
                out = zc.run(layer, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE))
                ref = moe_experts(x.double(), ids, w.double(), gate_up[layer].double(), down[layer].double())
                torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-4)
                lookups += len(ids.unique())
            zc.after_step(n_tokens)
        zc.drain()
    finally:
        zc.close()
    return zc, cache, lookups


@pytest.mark.parametrize("n_slots", [1, 4, L * E - 1])
@pytest.mark.parametrize("split", [EVEN, ALL])
def test_outputs_equal_resident_with_part_of_the_misses_on_the_cpu(n_slots, split):
    zc, cache, lookups = _decode(n_slots, split)
    lru, t = cache.lru, zc.telemetry()
    assert lru.hits + lru.misses == lookups
    assert t["cpu_experts"] > 0 and t["cpu_experts"] + t["zero_copy_experts"] == lru.misses
    assert t["cpu_mailbox"]["experts"] == t["cpu_experts"]
    if split == ALL:  # every miss computed on the CPU: nothing read over the link, nothing filled
        assert t["zero_copy_experts"] == 0 and t["graph_fills"] == 0 and t["link_bytes"] == 0 and len(lru) == 0
    else:
        assert t["graph_fills"] > 0


@pytest.mark.parametrize("n_slots, placed", [(1, 0), (4, 4)])
def test_a_split_without_the_link_sends_every_miss_to_the_cpu_and_never_changes_the_slots(n_slots, placed):
    """static (slots placed once) and cpu-only (a pool of one slot that nothing takes): outputs as
    resident, every miss computed on the CPU, nothing read over the link or filled, the cached entries
    those placed."""
    store, gate_up, down = _store()
    cache = ExpertCache(n_slots, H, I, torch.float32, torch.device(DEVICE))
    for e in range(placed):  # placed at load, as static's hot experts are
        cache.lru.place(0, e)
        cache.copy_in(e, store.block(0, e))
    entries = sorted(cache.lru.entries)
    zc = ZeroCopyDecode(store, cache, torch.device(DEVICE), max_tokens=4, cpu_split=_split(*NO_LINK))
    g = torch.Generator().manual_seed(3)
    try:
        for _ in range(4):
            zc.before_step()
            for layer in range(L):
                x, w = torch.randn(2, H, generator=g), torch.softmax(torch.randn(2, K, generator=g), -1)
                ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(2)])
                out = zc.run(layer, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE))
                ref = moe_experts(x.double(), ids, w.double(), gate_up[layer].double(), down[layer].double())
                torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-4)
            zc.after_step(2)
        zc.drain()
        t = zc.telemetry()
    finally:
        zc.close()
    assert t["cpu_experts"] == cache.lru.misses > 0 and t["zero_copy_experts"] == 0
    assert t["graph_fills"] == 0 and t["link_bytes"] == 0 and sorted(cache.lru.entries) == entries
    assert len(cache.lru) == placed  # cpu-only's lone slot stays free
    assert zc.runnable and not zc.cpu_split.uses_link


def test_a_split_without_the_link_that_loses_its_mailbox_goes_back_to_pieces():
    """Without the native worker a static or cpu-only table cannot send its misses anywhere but the
    link, which those policies never use: its steps are not the one graph."""
    zc = ZeroCopyDecode(_store()[0], ExpertCache(1, H, I, torch.float32, torch.device(DEVICE)),
                        torch.device(DEVICE), max_tokens=4, cpu_split=_split(*NO_LINK))
    assert zc.runnable
    zc.mailbox_failed = zc.mailbox_off = "the CPU mailbox needs the native extension"
    assert not zc.runnable
    zc.cpu_split = _split(*EVEN)  # adaptive reads its misses over the link instead
    assert zc.runnable


def test_a_worker_that_does_not_answer_fails_the_step_loudly():
    store, gate_up, down = _store()
    cache = ExpertCache(2, H, I, torch.float32, torch.device(DEVICE))
    zc = ZeroCopyDecode(store, cache, torch.device(DEVICE), max_tokens=4, lag_list_share=1.0,
                        cpu_split=_split(*ALL))
    zc.before_step()
    x, w = torch.randn(1, H), torch.ones(1, K) / K
    zc.run(0, x.to(DEVICE), torch.tensor([[0, 1]], device=DEVICE), w.to(DEVICE))  # opens the mailbox; answered
    zc.mailbox.close()  # the worker is gone
    zc.mailbox.max_polls = 20
    zc.run(1, x.to(DEVICE), torch.tensor([[2, 3]], device=DEVICE), w.to(DEVICE))
    zc.after_step(1)
    with pytest.raises(RuntimeError, match="did not answer in time"):
        zc.drain()


def _post_split(m, split):
    """The device's split of one layer with m missed experts (of 6, one token each, top-1 rows):
    how many went to the CPU."""
    box = CpuMailbox(_store()[0], torch.device(DEVICE), max_rows=E, top_k=1, split=split)
    try:
        offsets = torch.zeros(E, dtype=torch.int64)  # in the pool
        offsets[:m] = 10**12  # the first m experts miss
        ids = torch.arange(E).view(E, 1)
        gpu_ids = torch.empty(E, dtype=torch.int64, device=DEVICE)
        log, cpu_log = torch.empty_like(gpu_ids), torch.empty_like(gpu_ids)
        box.post(0, torch.randn(E, H).to(DEVICE), ids.to(DEVICE), torch.ones(E, 1).to(DEVICE), offsets.to(DEVICE),
                 100, gpu_ids, log, cpu_log)
        marks = cpu_log.cpu().tolist()
        if sum(marks):
            _wait_for(lambda: int(box.done[0]) == 1)
        return marks
    finally:
        box.close()


@pytest.mark.parametrize("split", [(0.235, 0.067, 0.25), (0.235, 0.3, 0.05), (1.0, 1.0, 0.0), (0.1, 0.5, 0.0),
                                   (0.5, 0.1, 2.0)])
def test_the_device_sends_the_cpu_the_count_that_ends_the_layer_soonest(split):
    """For given costs, the count of missed experts the CPU takes is the integer c in [0, m] with the
    least max((m − c) · link, handoff + c · cpu) (no handoff at c = 0), the fewer on a tie; they are the
    first missed experts in pair order. (The first costs: the H100 host's measured ones, BF16.)"""
    link, cpu, handoff = split
    span = lambda m, c: max((m - c) * link, handoff + c * cpu if c else 0.0)  # noqa: E731
    for m in range(E + 1):
        want = min(range(m + 1), key=lambda c: (round(span(m, c), 9), c))
        marks = _post_split(m, split)
        assert marks == [1] * want + [0] * (E - want), (m, want)


def test_the_split_reads_the_decode_model_and_the_workers_posts_correct_it():
    """Posts of 1 to 4 experts taking 0.25 ms + 0.07 ms each: after MEASURE_POSTS of them the split's
    CPU costs are that line, and so are the decode model's (the pieces' planner reads the same model);
    prefill's stays. Posts all of one size keep the per-post cost and give the experts the rest."""
    costs = ExpertCostModel.from_shape(2048, 768, 2)
    measured = MeasuredCosts(costs)
    split = MissSplit(measured)
    assert split.values() == pytest.approx((costs.zero_copy_ms(), costs.cpu_expert_ms(1), costs.cpu_overhead_ms))
    assert split.values()[0] == pytest.approx(9437184 / 38.6e6)  # a BF16 expert over PCIe at the model's 38.6 GB/s
    assert MissSplit(measured, link=False).values()[0] == LINK_NEVER_MS

    def sums(sizes):
        c, t = np.array(sizes, float), 2.5e-4 + 7e-5 * np.array(sizes, float)
        return [len(c), c.sum(), (c * c).sum(), t.sum(), (c * t).sum()]

    sizes = [1, 2, 3, 4] * (MEASURE_POSTS // 4)
    assert not split.observe(sums(sizes[:-1]))  # one post short of a window
    assert split.observe(sums(sizes)) and split.is_measured
    assert split.values()[1:] == pytest.approx((0.07, 0.25))
    decode = measured.model("decode")
    assert (decode.cpu_expert_ms(1), decode.cpu_ms(3, 3)) == pytest.approx((0.07, 0.25 + 3 * 0.07))
    assert measured.model("prefill") is costs
    later = np.add(sums(sizes), sums([2] * MEASURE_POSTS))  # a window of posts of 2 experts, 0.39 ms each
    assert split.observe(later)
    assert split.values()[1:] == pytest.approx((0.07, 0.25))
    assert split.telemetry()["cpu_measured"] is True


def test_the_pieces_cpu_sets_move_the_split_the_graph_runs_with():
    """Decode's CPU sets measured in pieces correct the same model the device's split reads."""
    measured = MeasuredCosts(ExpertCostModel.from_shape(2048, 768, 2))
    split = MissSplit(measured)
    before = split.values()
    decode = measured.model("decode")
    for _ in range(CPU_CORRECTION_WINDOW):  # CPU sets twice as slow as modelled: one correction's window
        measured.observe_cpu("decode", decode.cpu_ms(2, 2), 2 * decode.cpu_ms(2, 2))
    assert split.values()[0] == before[0]
    assert split.values()[1:] == pytest.approx((2 * before[1], 2 * before[2]))


def test_the_environment_keeps_the_cpu_out_of_the_graph(monkeypatch):
    monkeypatch.delenv("TANDEM_GRAPH_CPU", raising=False)
    assert graph_cpu_enabled()
    monkeypatch.setenv("TANDEM_GRAPH_CPU", "0")
    assert not graph_cpu_enabled()
    zc = ZeroCopyDecode(_store()[0], ExpertCache(2, H, I, torch.float32, torch.device(DEVICE)),
                        torch.device(DEVICE), max_tokens=4)
    assert zc.telemetry()["cpu_mailbox"] == {"off": "no CPU split"} and zc.telemetry()["cpu_split"] is None


def test_a_cache_with_a_slot_for_every_expert_opens_no_mailbox():
    """Nothing can miss: the graph carries no post and no wait."""
    zc, cache, _ = _decode(L * E, EVEN, steps=2)
    t = zc.telemetry()
    assert t["cpu_mailbox"] == {"off": "every expert has a slot"} and t["cpu_experts"] == 0
    assert cache.lru.misses > 0 and t["zero_copy_experts"] == cache.lru.misses  # the first reads still missed


def test_the_measured_costs_reach_the_device_between_steps():
    """Each before_step hands the worker's posts to the split; once it has measured them, the device's
    costs are the split's."""
    zc, cache, _ = _decode(1, ALL, steps=MEASURE_POSTS // L + 2)
    t = zc.telemetry()
    assert t["cpu_mailbox"]["posts"] >= MEASURE_POSTS and t["cpu_split"]["cpu_measured"]
    assert t["cpu_split"]["link_ms"] == 1.0  # the link's cost stays the one given
    assert zc.mailbox.split_values == zc.cpu_split.values() != _split(*ALL).values()
    assert zc.mailbox.split.cpu().tolist() == pytest.approx(list(zc.cpu_split.values()))


def test_a_post_the_worker_cannot_read_is_answered_with_an_error():
    """A post naming a layer out of range (a torn or stale mailbox): the worker still answers, so no
    kernel waits out its polls, marks the answer failed and keeps the reason for the host's check."""
    store = _store()[0]
    box = CpuMailbox(store, torch.device(DEVICE), max_rows=4, top_k=K, split=EVEN)
    try:
        box.to_cpu[8], box.to_cpu[9] = L + 5, 1  # layer, rows
        box.to_cpu[0] = 1  # the post, written here as the device would
        _wait_for(lambda: int(box.done[0]) == 1)
        assert int(box.to_gpu[8]) == 1  # the answer's status: failed
        with pytest.raises(RuntimeError, match="layer out of range"):
            box.check()
    finally:
        box.close()


@pytest.mark.parametrize("cores, team", [(16, 15), (2, 1), (1, 1)])
def test_the_worker_leaves_the_driving_thread_a_core(cores, team):
    """The driving thread spins in the CUDA runtime while a graph step runs: the worker's team is
    every core the native kernels use but that one (never fewer than one thread)."""
    before = native.threads_setting()
    native.set_threads(cores)
    try:
        assert worker_threads() == team
        box = CpuMailbox(_store()[0], torch.device(DEVICE), max_rows=4, top_k=K, split=EVEN)
        try:
            assert box.telemetry()["threads"] == team
        finally:
            box.close()
        box = CpuMailbox(_store()[0], torch.device(DEVICE), max_rows=4, top_k=K, split=EVEN, threads=3)
        assert box.telemetry()["threads"] == 3  # a caller's team is kept as given
        box.close()
    finally:
        native.set_threads(before)
