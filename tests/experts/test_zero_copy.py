"""The whole-step decode path of offloaded experts (engine/experts/zero_copy.py), driven step by step
as DecodeGraphs drives it, on the GPU where CUDA exists, else on the CPU (the expert kernels through
Triton's interpreter): outputs equal resident execution while the table, the LRU and the list of free
slots change between steps; misses enter the cache in the slots they filled; every slot is in exactly
one place; the table is the LRU's after a rebuild."""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from engine.experts.cache import ExpertCache  # noqa: E402
from engine.experts.cpu_mailbox import MissSplit  # noqa: E402
from engine.experts.measured_costs import MeasuredCosts  # noqa: E402
from engine.experts.store import ExpertStore  # noqa: E402
from engine.experts.zero_copy import LAG_LIST_SHARE, ZeroCopyDecode  # noqa: E402
from engine.kernels.experts_torch import moe_experts  # noqa: E402
from engine.sched.expert_cost import ExpertCostModel  # noqa: E402

L, E, H, I, K = 3, 6, 24, 16, 2
# the kernels run compiled on CUDA tensors, or interpreted on CPU tensors where there is no GPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on a GPU machine these run on CUDA: marked so that `-m cuda` (the lease scripts) selects them
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []


def _even_split():
    """The link and the CPU alike (1 ms an expert each, no per-post cost): half the misses to each."""
    costs = ExpertCostModel(expert_bytes=1e6, flops_per_token=0.0, zero_copy_gbps=1.0, cpu_gbps=1.0,
                            cpu_overhead_ms=0.0)
    return MissSplit(MeasuredCosts(costs))


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = [torch.randn(E, 2 * I, H, generator=g) / H**0.5 for _ in range(L)]
    down = [torch.randn(E, H, I, generator=g) / I**0.5 for _ in range(L)]
    return gate_up, down


QH, QI = 64, 32  # a quantised store's widths: whole 32-weight blocks


def _quant_store(seed=0):
    """A store of Q8_0 gate / Q4_1 up / Q8_0 down blocks (QH, QI) and the same experts dequantised:
    (store, gate_up (E, 2QI, QH) per layer, down (E, QH, QI) per layer) in fp32."""
    from gguf import GGMLQuantizationType as T

    from engine.quant.blocks import QuantRows, QuantStack, QuantTensor

    rng = np.random.default_rng(seed)

    def stack(qtype, rows, cols):
        nb, bb = cols // 32, {T.Q8_0: 34, T.Q4_1: 20}[qtype]
        data = rng.integers(0, 256, (E * rows, nb, bb), dtype=np.uint8)
        data[:, :, 0:2] = (rng.uniform(-0.01, 0.01, (E * rows, nb)).astype(np.float16)).view(np.uint8).reshape(
            E * rows, nb, 2)  # d: small, so that the SiLU sees values of order one
        if qtype == T.Q4_1:
            data[:, :, 2:4] = (rng.uniform(-0.05, 0.05, (E * rows, nb)).astype(np.float16)).view(np.uint8).reshape(
                E * rows, nb, 2)
        whole = QuantTensor.from_gguf(data.reshape(E * rows, -1), int(qtype), "w")
        return QuantStack([whole[e * rows:(e + 1) * rows] for e in range(E)])

    gate_up, down = [], []
    for _ in range(L):
        gs, us = stack(T.Q8_0, QI, QH), stack(T.Q4_1, QI, QH)
        gate_up.append(QuantStack([QuantRows([a, b]) for a, b in zip(gs.experts, us.experts)]))
        down.append(stack(T.Q8_0, QH, QI))
    store = ExpertStore.from_quant_layers(gate_up, down, dtype=torch.float32, pin=DEVICE == "cuda")
    return store, [g.dequantize() for g in gate_up], [d.dequantize() for d in down]


def _check_slots(zc, cache):
    """Every slot is cached, free, or listed for the next step's misses: exactly one of them."""
    lru = cache.lru
    places = [ent.slot for ent in lru.entries.values()] + list(lru.free) + zc.held()
    assert sorted(places) == list(range(cache.n_slots))


def _check_table(zc, cache, store):
    """Once every log is read, the device's table (which keeps itself) is the LRU's; the lists on the
    device are the next step's."""
    zc.drain()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    table = zc.table.cpu().numpy()
    want = zc.host_offsets.copy()
    for (layer, e), ent in cache.lru.entries.items():
        want[layer, e] = ent.slot * zc.slot_numel
    assert (table == want).all()
    if zc._next is None:  # no step listed since the last one ran
        return
    listed, victims = zc.spares.cpu().numpy(), zc.victims.cpu().numpy()
    held, victim_keys = zc.listed()
    slots = held + [cache.lru.slot_of(key) for key in victim_keys]  # free ones, then cached ones
    assert listed[:len(slots)].tolist() == [s * zc.slot_numel for s in slots]
    assert (listed[len(slots):] == -1).all()
    assert victims[:len(slots)].tolist() == [-1] * len(held) + [l * E + e for l, e in victim_keys]
    assert len(set(slots)) == len(slots)


def _decode(n_slots, steps, n_tokens=2, seed=1, same_routing=False, check_each_step=True, lag_list_share=1.0,
            inflight=None, quantised=False, cpu_split=False):
    """lag_list_share 1.0: the host always lists a step's slots before reading the step before's log
    (caches this small would read it first under the default). inflight: the steps whose logs are
    unread after each before_step, appended to. quantised: a store of blocks (`_quant_store`), slots
    of bytes. cpu_split: the CPU mailbox takes half of each layer's misses (link and CPU costed alike)."""
    if quantised:
        store, gate_up, down = _quant_store()
        h, i = QH, QI
        cache = ExpertCache(n_slots, h, i, torch.float32, torch.device(DEVICE), block_bytes=store.block_bytes)
    else:
        gate_up, down = _model()
        h, i = H, I
        store = ExpertStore.from_layers(gate_up, down, dtype=torch.float32, pin=DEVICE == "cuda")
        cache = ExpertCache(n_slots, h, i, torch.float32, torch.device(DEVICE))
    window = []
    zc = ZeroCopyDecode(store, cache, torch.device(DEVICE), max_tokens=4, window=window,
                        lag_list_share=lag_list_share,
                        cpu_split=_even_split() if cpu_split else None)
    g = torch.Generator().manual_seed(seed)
    routing = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n_tokens)]) for _ in range(L)]
    used_per_step = []
    for step in range(steps):
        zc.before_step()
        if inflight is not None:
            inflight.append(len(zc._inflight))
        _check_slots(zc, cache)
        if check_each_step:  # (reads the step before's logs now: the host no longer lags a step)
            _check_table(zc, cache, store)
        used = set()
        for layer in range(L):
            x = torch.randn(n_tokens, h, generator=g)
            # a few popular experts, and now and then anything, so that the cache has something to learn
            ids = routing[layer] if same_routing else \
                torch.stack([torch.randperm(3 if step % 4 else E, generator=g)[:K] for _ in range(n_tokens)])
            w = torch.softmax(torch.randn(n_tokens, K, generator=g), -1)
            out = zc.run(layer, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE))
            ref = moe_experts(x.double(), ids, w.double(), gate_up[layer].double(), down[layer].double())
            if quantised and cpu_split:  # the CPU's products over blocks take the activations in int16
                # (native/quant_kernels.h): 2^-16 of a block's largest, in x and again in act: a few 1e-5
                # of the largest output
                assert (out.cpu().double() - ref).abs().max() <= 2.5e-4 * ref.abs().max()
            else:
                torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-4)
            used |= {(layer, int(e)) for e in ids.unique()}
        zc.after_step(n_tokens)
        used_per_step.append(used)
    zc.before_step()
    _check_slots(zc, cache)
    _check_table(zc, cache, store)
    return zc, store, cache, window, used_per_step


@pytest.mark.parametrize("n_slots", [1, 4, 8, L * E])
def test_outputs_equal_resident_while_the_host_reads_each_log_a_step_late(n_slots):
    """The host lists a step's slots before the step before has been read: the device's table keeps
    itself meanwhile (fills admitted by the sum kernel, victims dropped by the claim kernel), and the
    slots listed for a step in flight are not listed again."""
    zc, store, cache, window, used = _decode(n_slots, steps=12, check_each_step=False)
    lru = cache.lru
    assert lru.hits + lru.misses == sum(len(u) for u in used)
    assert lru.fills > 0 and (lru.hits > 0 or n_slots == 1)
    for (layer, e), ent in lru.entries.items():  # each slot holds its expert's weights
        assert torch.equal(cache.pool[ent.slot].cpu(), store.block(layer, e))


@pytest.mark.parametrize("n_slots", [4, L * E])
def test_outputs_equal_resident_when_the_host_reads_each_log_before_listing(n_slots):
    """A tight cache (the list a large share of it): the host reads the step before's log first, so
    the list sees every slot and the LRU as that step left it."""
    inflight = []
    zc, store, cache, window, used = _decode(n_slots, steps=10, check_each_step=False, lag_list_share=0.0,
                                             inflight=inflight)
    assert inflight == [0] * 10
    assert cache.lru.hits + cache.lru.misses == sum(len(u) for u in used) and cache.lru.fills > 0


@pytest.mark.parametrize("n_slots, lags", [(8, False), (400, True)])
def test_the_host_runs_a_step_ahead_only_where_the_list_is_a_small_share_of_the_cache(n_slots, lags):
    inflight = []
    _decode(n_slots, steps=4, check_each_step=False, lag_list_share=LAG_LIST_SHARE, inflight=inflight)
    assert inflight == [0] + [1 if lags else 0] * 3  # (the first step has none before it)


@pytest.mark.parametrize("n_slots,quantised", [(1, False), (4, False), (L * E, False), (4, True)])
def test_outputs_equal_resident_while_the_cache_changes(n_slots, quantised):
    """quantised: misses read as blocks from the store and copied into byte slots on the way."""
    zc, store, cache, window, used = _decode(n_slots, steps=9, quantised=quantised)
    lru = cache.lru
    t = zc.telemetry()
    lookups = sum(len(u) for u in used)
    assert lru.hits + lru.misses == lookups  # each (layer, expert) of a step counted once
    assert t["zero_copy_experts"] == lru.misses > 0
    assert t["graph_fills"] == lru.fills > 0 and len(lru) <= n_slots
    assert sum(n for _, n in window) == lookups and sum(h for h, _ in window) == lru.hits
    assert lru.hits > 0 or n_slots == 1


def test_link_bytes_count_each_in_place_read_once_and_fills_nothing_more():
    """One token: each miss is one pair, read over the link once, and its fill writes what that read
    brought (the telemetry once counted the fill again: twice the link's real rate at bs=1)."""
    zc, store, cache, _, _ = _decode(4, steps=6, n_tokens=1)
    t = zc.telemetry()
    assert t["graph_fills"] > 0 and t["link_bytes"] == zc.zero_copy_experts * store.block_bytes


def test_a_quantised_store_sends_part_of_its_misses_to_the_cpu():
    """The CPU mailbox's worker computes its share of the misses over the store's blocks (native
    quant_moe), beside the GPU kernels over the rest: outputs as resident, the CPU's experts counted."""
    from engine.kernels import native

    if native.module() is None or not hasattr(native.module(), "CpuMailbox"):
        pytest.skip("the CPU mailbox needs the native extension")
    zc, store, cache, window, used = _decode(4, steps=6, quantised=True, cpu_split=True)
    t = zc.telemetry()
    assert t["cpu_experts"] > 0 and t["cpu_mailbox"]["experts"] == t["cpu_experts"]
    assert t["cpu_experts"] + t["zero_copy_experts"] == cache.lru.misses
    zc.close()


@pytest.mark.parametrize("quantised", [False, True])
def test_a_missed_expert_hits_from_the_slot_it_filled(quantised):
    """Same routing every step and room for it: a miss fills a listed slot on the way (the first list
    is short: some misses wait for the next step's, which follows the misses seen); then everything
    hits, and no expert was filled twice."""
    zc, store, cache, _, used = _decode(4 * L * E, steps=4, same_routing=True, quantised=quantised)
    first = len(used[0])
    assert cache.lru.fills == first and zc.telemetry()["graph_fills"] == first
    assert cache.lru.hits + cache.lru.misses == 4 * first and cache.lru.misses <= 2 * first
    assert cache.lru.hits >= 2 * first  # the last two steps hit everything
    for (layer, e), ent in cache.lru.entries.items():  # the slot holds the expert's weights
        assert torch.equal(cache.pool[ent.slot].cpu(), store.block(layer, e))


def test_leaving_hands_the_listed_slots_back_and_a_rebuild_follows_the_lru():
    zc, store, cache, _, _ = _decode(8, steps=3)
    held, victims = zc.listed()
    assert held or victims
    zc.leave()
    assert zc.held() == [] and zc.listed() == ([], []) and set(held) <= set(cache.lru.free) and zc.stale
    slot, _ = cache.lru.admit(0, 5) if (0, 5) not in cache.lru else (None, None)  # the other path fills
    cache.lru.unlock()
    zc.before_step()
    assert not zc.stale
    _check_slots(zc, cache)
    _check_table(zc, cache, store)


def test_an_eager_layer_after_a_graph_step_reads_its_log_first():
    """A prefill or an eager step right after a graph replay changes the LRU (fills evict) while the
    replay's log is still unread: the log must be read first, or its hits may name evicted experts
    (KeyError at the next replay, seen on the H200 in a bench's second round)."""
    from engine.experts.offload import OffloadedExperts

    gate_up, down = _model()
    store = ExpertStore.from_layers(gate_up, down, dtype=torch.float32, pin=DEVICE == "cuda")
    # on-demand: every eager miss is filled, so eager layers evict; the device table is attached by hand
    # (OffloadedExperts opens one only for adaptive on CUDA)
    ex = OffloadedExperts("on-demand", store, device=torch.device(DEVICE), n_slots=12, max_decode_tokens=4)
    zc = ex.zero_copy = ZeroCopyDecode(store, ex.cache, torch.device(DEVICE), max_tokens=4)
    g = torch.Generator().manual_seed(3)
    for step in range(6):
        zc.before_step()
        for layer in range(L):  # a graph step: the same two experts each layer, which then hit
            ids = torch.tensor([[0, 1], [1, 0]])
            x, w = torch.randn(2, H, generator=g), torch.full((2, K), 0.5)
            zc.run(layer, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE))
        zc.after_step(2)
        for layer in range(L):  # eager layers on other experts: their fills evict the graph's hits
            ids = torch.tensor([[2 + step % 4, 3], [4, 5]])
            x, w = torch.randn(2, H, generator=g), torch.full((2, K), 0.5)
            out = ex.run(layer, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE))
            ref = moe_experts(x.double(), ids, w.double(), gate_up[layer].double(), down[layer].double())
            torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-4)
    zc.before_step()
    _check_slots(zc, ex.cache)
    _check_table(zc, ex.cache, store)
    assert ex.cache.lru.hits > 0 and zc.telemetry()["graph_steps"] == 6


def _full_cache(order):
    """A cache holding exactly `order` ((layer, expert), least recent first), its slots filled."""
    gate_up, down = _model()
    store = ExpertStore.from_layers(gate_up, down, dtype=torch.float32, pin=DEVICE == "cuda")
    cache = ExpertCache(len(order), H, I, torch.float32, torch.device(DEVICE))
    for layer, e in order:
        slot, _ = cache.lru.admit(layer, e)
        cache.copy_in(slot, store.block(layer, e))
    cache.lru.unlock()
    cache.lru.fills = 0
    zc = ZeroCopyDecode(store, cache, torch.device(DEVICE), max_tokens=4, lag_list_share=1.0)
    return zc, store, cache, gate_up, down


def _graph_step(zc, routing, gate_up, down, seed=0):
    """One replay's worth of layers with the given routing (layer → (1, k) ids), checked against resident."""
    g = torch.Generator().manual_seed(seed)
    for layer, ids in enumerate(routing):
        x, w = torch.randn(1, H, generator=g), torch.softmax(torch.randn(1, K, generator=g), -1)
        out = zc.run(layer, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE))
        ref = moe_experts(x.double(), ids, w.double(), gate_up[layer].double(), down[layer].double())
        torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-4)
    zc.after_step(1)


ORDER = [(2, 0), (2, 2), (0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 3)]  # least recent first


def test_listed_slots_keep_their_experts_cached_until_a_miss_claims_them():
    """A full cache whose entries every step hits: the slots listed for misses are its oldest entries'
    and stay cached (listing once evicted them ahead: a quarter of a small cache stood empty)."""
    zc, store, cache, gate_up, down = _full_cache(ORDER)
    routing = [torch.tensor([[1, 2]]), torch.tensor([[1, 2]]), torch.tensor([[0, 2]])]
    for step in range(4):
        zc.before_step()
        held, victims = zc.listed()
        assert victims and not held  # no free slot: cached entries are listed
        _check_slots(zc, cache)
        _graph_step(zc, routing, gate_up, down, seed=step)
    zc.drain()
    lru = cache.lru
    assert lru.misses == 0 and lru.evictions == 0 and lru.hits == 4 * 6 and len(lru) == len(ORDER)


def test_a_victim_claimed_before_its_layer_is_read_from_the_store_then_replaced():
    """Layer 0's miss claims the slot of (2, 0), the oldest entry; layer 2 then routes expert 0: it must
    read the store, not the slot now holding (0, 4), and count as a miss. Its own claim takes the
    next listed slot, that of (2, 2), which layer 2 also routes (read from the store either way)."""
    zc, store, cache, gate_up, down = _full_cache(ORDER)
    zc.before_step()
    assert zc.listed() == ([], [(2, 0), (2, 2)])  # the two listed slots, oldest first
    slot_20, slot_22 = cache.lru.slot_of((2, 0)), cache.lru.slot_of((2, 2))
    _graph_step(zc, [torch.tensor([[1, 4]]), torch.tensor([[1, 2]]), torch.tensor([[0, 2]])], gate_up, down)
    zc.drain()
    lru = cache.lru
    assert lru.hits == 3 and lru.misses == 3  # (0,1), (1,1), (1,2) hit; (0,4), (2,0), (2,2) missed
    assert lru.slot_of((0, 4)) == slot_20 and lru.slot_of((2, 0)) == slot_22 and (2, 2) not in lru
    assert lru.evictions == 2 and lru.fills == 2
    for key in ((0, 4), (2, 0)):
        assert torch.equal(cache.pool[lru.slot_of(key)].cpu(), store.block(*key))
    _check_slots(zc, cache)
    _check_table(zc, cache, store)


def test_layers_run_without_after_step_are_accounted_before_the_next_replay():
    """A graph's warm-up runs every layer eagerly and no after_step follows (the capture is not run).
    Its misses claimed listed slots, victims' slots among them, and wrote other weights there: the next
    step must read those victims from the store, so the warm-up's log is read as a step's first."""
    zc, store, cache, gate_up, down = _full_cache(ORDER)
    zc.before_step()
    assert zc.listed() == ([], [(2, 0), (2, 2)])
    old_slots = [cache.lru.slot_of((2, 0)), cache.lru.slot_of((2, 2))]
    g = torch.Generator().manual_seed(4)
    for layer, ids in enumerate([torch.tensor([[4, 5]]), torch.tensor([[1, 2]]), torch.tensor([[1, 3]])]):
        x, w = torch.randn(1, H, generator=g), torch.full((1, K), 0.5)
        zc.run(layer, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE))  # the warm-up: (0,4), (0,5) take both slots
    steps = zc.steps
    zc.before_step()  # logs the warm-up as a step; its slots are not listed again while it is in flight
    assert zc.steps == steps and not {(2, 0), (2, 2)} & set(zc.listed()[1])  # not a replay
    _check_slots(zc, cache)
    # layer 2 routes both former victims: read from the store, so the outputs equal resident
    _graph_step(zc, [torch.tensor([[1, 2]]), torch.tensor([[1, 2]]), torch.tensor([[0, 2]])], gate_up, down)
    zc.drain()
    lru = cache.lru
    assert {lru.slot_of((0, 4)), lru.slot_of((0, 5))} == set(old_slots)  # the warm-up's fills
    assert lru.slot_of((2, 0)) not in old_slots and lru.slot_of((2, 2)) not in old_slots  # filled again
    for key in lru.entries:
        assert torch.equal(cache.pool[lru.slot_of(key)].cpu(), store.block(*key))
    _check_slots(zc, cache)
    _check_table(zc, cache, store)
