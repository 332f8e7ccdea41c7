"""The CPU's share of a graph step's misses (engine/experts/cpu_mailbox.py): the device splits a layer's
misses and posts the CPU's part to pinned memory, the native worker answers, the sum kernel waits for
it. On the GPU where CUDA exists, else with the kernels under Triton's interpreter and the same native
worker: outputs equal resident execution for any share and cache size; the CPU's experts are counted
as misses and never fill a slot; a worker that does not answer makes the step fail loudly."""

import time

import pytest
import torch

pytest.importorskip("triton")

from engine.experts.cache import ExpertCache  # noqa: E402
from engine.experts.cpu_mailbox import CPU_CHURN_SHARE, GRAPH_CPU_SHARE, CpuMailbox, default_share, worker_threads  # noqa: E402
from engine.experts.store import ExpertStore  # noqa: E402
from engine.experts.zero_copy import ZeroCopyDecode  # noqa: E402
from engine.kernels import native  # noqa: E402
from engine.kernels.experts_torch import expert_ffn, moe_experts  # noqa: E402

if native.module() is None or not hasattr(native.module(), "CpuMailbox"):
    pytest.skip("the CPU mailbox needs the native extension", allow_module_level=True)

L, E, H, I, K = 3, 6, 32, 16, 2  # the CPU kernels take hidden and inter in multiples of 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on a GPU machine these run on CUDA: marked so that `-m cuda` (the lease scripts) selects them
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []


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
    """Two tokens, top-2: expert 1 is cached, 3 and 5 are not. Share 0.5 of two missed experts is
    one: the first in pair order, 3, goes to the CPU (both of its pairs); the worker's sum is expert
    3's weighted output for each token."""
    store, gate_up, down = _store()
    box = CpuMailbox(store, torch.device(DEVICE), max_rows=4, top_k=K, share=0.5)
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
        # one missed expert: floor(0.5 · 1) = 0, it stays on the link (and fills a slot); nothing is
        # posted, and the sum waits for nothing
        offsets[3] = 0
        out_ids = box.post(1, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), offsets.to(DEVICE), 100, gpu_ids, log,
                           cpu_log)
        assert out_ids.cpu().tolist() == ids.tolist() and cpu_log.cpu().tolist() == [0] * 4
        assert int(box.expect.cpu()) == 0 and int(box.seq.cpu()) == 1
        # at share 1 every miss goes: the next post is number 2
        box.set_share(1.0)
        box.post(2, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), offsets.to(DEVICE), 100, gpu_ids, log, cpu_log)
        assert cpu_log.cpu().tolist() == [0, 0, 0, 1] and int(box.expect.cpu()) == 2
        _wait_for(lambda: int(box.done[0]) == 2)
    finally:
        box.close()


def _decode(n_slots, share, steps=8, n_tokens=2, seed=1, gated=False, same_routing=False):
    store, gate_up, down = _store()
    cache = ExpertCache(n_slots, H, I, torch.float32, torch.device(DEVICE))
    zc = ZeroCopyDecode(store, cache, torch.device(DEVICE), max_tokens=4, lag_list_share=1.0, cpu_share=share,
                        cpu_gated=gated)
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


@pytest.mark.parametrize("n_slots", [1, 4, L * E])
@pytest.mark.parametrize("share", [0.5, 1.0])
def test_outputs_equal_resident_with_part_of_the_misses_on_the_cpu(n_slots, share):
    zc, cache, lookups = _decode(n_slots, share)
    lru, t = cache.lru, zc.telemetry()
    assert lru.hits + lru.misses == lookups
    assert t["cpu_experts"] > 0 and t["cpu_experts"] + t["zero_copy_experts"] == lru.misses
    assert t["cpu_mailbox"]["experts"] == t["cpu_experts"]
    if share == 1.0:  # every miss computed on the CPU: nothing read over the link, nothing filled
        assert t["zero_copy_experts"] == 0 and t["graph_fills"] == 0 and t["link_bytes"] == 0 and len(lru) == 0
    else:
        assert t["graph_fills"] > 0


def test_a_worker_that_does_not_answer_fails_the_step_loudly():
    store, gate_up, down = _store()
    cache = ExpertCache(2, H, I, torch.float32, torch.device(DEVICE))
    zc = ZeroCopyDecode(store, cache, torch.device(DEVICE), max_tokens=4, lag_list_share=1.0, cpu_share=1.0,
                        cpu_gated=False)
    zc.before_step()
    x, w = torch.randn(1, H), torch.ones(1, K) / K
    zc.run(0, x.to(DEVICE), torch.tensor([[0, 1]], device=DEVICE), w.to(DEVICE))  # opens the mailbox; answered
    zc.mailbox.close()  # the worker is gone
    zc.mailbox.max_polls = 20
    zc.run(1, x.to(DEVICE), torch.tensor([[2, 3]], device=DEVICE), w.to(DEVICE))
    zc.after_step(1)
    with pytest.raises(RuntimeError, match="did not answer in time"):
        zc.drain()


def test_the_share_comes_from_the_environment_or_the_measured_default(monkeypatch):
    monkeypatch.delenv("TANDEM_GRAPH_CPU_SHARE", raising=False)
    assert default_share() == GRAPH_CPU_SHARE
    monkeypatch.setenv("TANDEM_GRAPH_CPU_SHARE", "0")
    assert default_share() == 0.0
    monkeypatch.setenv("TANDEM_GRAPH_CPU_SHARE", "1.5")
    with pytest.raises(ValueError):
        default_share()
    zc = ZeroCopyDecode(_store()[0], ExpertCache(2, H, I, torch.float32, torch.device(DEVICE)),
                        torch.device(DEVICE), max_tokens=4, cpu_share=0.0)
    assert zc.telemetry()["cpu_mailbox"] == {"off": "cpu_share 0"}
    with pytest.raises(RuntimeError, match="no CPU mailbox"):
        zc.set_cpu_share(0.5)


def test_a_share_of_0_set_after_the_first_layer_keeps_the_mailbox_and_posts_nothing():
    """(How the bench compares shares on one graph.) Layer 0 ran at 0.75: floor(0.75 · 2) = 1 expert
    went to the CPU; the other layers, at 0, read every miss over PCIe."""
    store = _store()[0]
    cache = ExpertCache(2, H, I, torch.float32, torch.device(DEVICE))
    zc = ZeroCopyDecode(store, cache, torch.device(DEVICE), max_tokens=4, lag_list_share=1.0, cpu_share=0.75,
                        cpu_gated=False)
    x, w = torch.randn(1, H), torch.ones(1, K) / K
    with torch.inference_mode():  # as the engine runs its steps: the mailbox's tensors are inference tensors
        zc.before_step()
        zc.run(0, x.to(DEVICE), torch.tensor([[0, 1]], device=DEVICE), w.to(DEVICE))
    zc.set_cpu_share(0.0)  # outside inference mode, as the bench sets it (a first version refused the write)
    with torch.inference_mode():
        for layer in range(1, L):
            zc.run(layer, x.to(DEVICE), torch.tensor([[0, 1]], device=DEVICE), w.to(DEVICE))
        zc.after_step(1)
        zc.drain()
    t = zc.telemetry()
    zc.close()
    assert t["cpu_mailbox"]["posts"] == 1 and t["cpu_mailbox"]["share"] == 0.0 and t["cpu_experts"] == 1
    assert t["zero_copy_experts"] == cache.lru.misses - 1 > 0


def test_a_step_run_without_the_mailbox_kernels_posts_nothing_and_reads_no_stale_cpu_log():
    """With the gate shut a step runs a graph captured without the post and the wait (cpu=False,
    engine/runtime/decode_graph.py's "graph" form). The CPU log an earlier step left on the device
    is not this step's: read as such, it would count step 0's CPU experts again."""
    store, gate_up, down = _store()
    cache = ExpertCache(1, H, I, torch.float32, torch.device(DEVICE))
    zc = ZeroCopyDecode(store, cache, torch.device(DEVICE), max_tokens=4, lag_list_share=1.0, cpu_share=1.0,
                        cpu_gated=False)
    x, w, ids = torch.randn(1, H), torch.tensor([[0.25, 0.75]]), torch.tensor([[0, 1]])
    seen = []
    try:
        for cpu in (True, False):
            zc.before_step(cpu=cpu)
            for layer in range(L):
                out = zc.run(layer, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE))
                ref = moe_experts(x.double(), ids, w.double(), gate_up[layer].double(), down[layer].double())
                torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-4)
            zc.after_step(1)
            zc.drain()
            t = zc.telemetry()
            seen.append((t["cpu_mailbox"]["posts"], t["cpu_experts"], t["zero_copy_experts"]))
    finally:
        zc.close()
    # step 0: share 1, both experts of every layer on the CPU; step 1: every miss over the link
    assert seen == [(L, 2 * L, 0), (L, 2 * L, 2 * L)]


@pytest.mark.parametrize("n_slots, churns", [(1, True), (4 * L * E, False)])
def test_the_cpu_takes_its_share_only_while_the_cache_churns(n_slots, churns):
    """Gated (the default): the first step runs at share 0; then a cache of one slot keeps missing and
    the CPU takes its share, while a roomy cache under the same routing fills and then hits. Its first
    step misses 6 experts, above CPU_CHURN_SHARE of its 72 slots (5.8), but the average starts at 0:
    the gate stays shut and every miss enters the cache."""
    zc, cache, lookups = _decode(n_slots, 0.75, steps=6, gated=True, same_routing=True)
    t = zc.telemetry()
    assert (t["cpu_experts"] > 0) == churns and (t["cpu_mailbox"]["share"] == 0.75) == churns
    assert cache.lru.hits + cache.lru.misses == lookups
    if not churns:
        assert 6 > CPU_CHURN_SHARE * n_slots > t["missed_per_step"] and cache.lru.fills == L * 2


def test_a_post_the_worker_cannot_read_is_answered_with_an_error():
    """A post naming a layer out of range (a torn or stale mailbox): the worker still answers, so no
    kernel waits out its polls, marks the answer failed and keeps the reason for the host's check."""
    store = _store()[0]
    box = CpuMailbox(store, torch.device(DEVICE), max_rows=4, top_k=K, share=0.5)
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
        box = CpuMailbox(_store()[0], torch.device(DEVICE), max_rows=4, top_k=K, share=0.5)
        try:
            assert box.telemetry()["threads"] == team
        finally:
            box.close()
        box = CpuMailbox(_store()[0], torch.device(DEVICE), max_rows=4, top_k=K, share=0.5, threads=3)
        assert box.telemetry()["threads"] == 3  # a caller's team is kept as given
        box.close()
    finally:
        native.set_threads(before)
