"""The CPU's share of the misses inside the one decode graph (engine/experts/graph_cpu_set.py): the
claim kernel's split, the native job a host node runs, and the whole-step path with the share, on the
GPU where CUDA exists (host nodes in a stream), else on the CPU (the same steps in order)."""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from engine.experts.cache import ExpertCache  # noqa: E402
from engine.experts.graph_cpu_set import GraphCpuSet  # noqa: E402
from engine.experts.store import ExpertStore  # noqa: E402
from engine.experts.zero_copy import MARGINS, ModeChooser, ZeroCopyDecode, probe_length  # noqa: E402
from engine.kernels import moe_decode_gpu, native  # noqa: E402
from engine.kernels.experts_torch import moe_experts  # noqa: E402
from engine.sched.expert_cost import ExpertCostModel  # noqa: E402

L, E, H, I, K = 3, 8, 32, 16, 2  # the native kernels take multiples of 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_native = pytest.mark.skipif(native.module() is None or not hasattr(native.module(), "GraphCpuSets"),
                                  reason="the native extension is not built")


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = [torch.randn(E, 2 * I, H, generator=g) / H**0.5 for _ in range(L)]
    down = [torch.randn(E, H, I, generator=g) / I**0.5 for _ in range(L)]
    return gate_up, down


def _store(dtype=torch.float32):
    gate_up, down = _model()
    store = ExpertStore.from_layers([w.to(dtype) for w in gate_up], [w.to(dtype) for w in down], dtype=dtype,
                                    pin=DEVICE == "cuda")
    return store, gate_up, down


def _costs(store):
    return ExpertCostModel.from_shape(store.hidden, store.expert_ffn, store.blocks.element_size())


@pytest.mark.parametrize("share, n_cpu", [(0.0, 0), (0.5, 3), (1 / 3, 2), (1.0, 7)])
def test_the_claim_kernel_gives_the_cpu_every_miss_whose_rank_crosses_a_multiple_of_one_over_share(share, n_cpu):
    """7 misses in a layer (and 3 hits): ⌊7·share⌋ go to the CPU, claim no slot, and are the pairs
    cpu_ids names and gpu_ids skips; the others claim slots as before."""
    dev = torch.device(DEVICE)
    pool_numel, slot = 100, 10
    offsets = torch.full((E,), 10_000, dtype=torch.int64)  # outside the pool: read from the store
    offsets[[0, 1, 2]] = torch.tensor([0, slot, 2 * slot])  # experts 0–2 sit in slots
    ids = torch.tensor([[0, 3], [1, 4], [2, 5], [6, 7], [3, 4], [5, 6]])  # 3 hits, 9 pairs of missed experts …
    ids = ids[:5]  # … cut to 7 misses
    P = ids.numel()
    spares = torch.arange(3, 3 + 16, dtype=torch.int64) * slot
    counter, rank = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    cpu_ids, gpu_ids = torch.empty(P, dtype=torch.int64), torch.empty(P, dtype=torch.int64)
    t = [v.to(dev) for v in (ids, offsets, spares, counter, rank, cpu_ids, gpu_ids)]
    ids_d, offsets_d, spares_d, counter_d, rank_d, cpu_d, gpu_d = t
    spare = moe_decode_gpu.claim_free_slots(ids_d, offsets_d, spares_d, counter_d, pool_numel,
                                            cpu=(torch.tensor([share], device=dev), rank_d, cpu_d, gpu_d))
    spare, cpu_ids, gpu_ids, flat = spare.cpu(), cpu_d.cpu(), gpu_d.cpu(), ids.reshape(-1)
    missed = offsets[flat] >= pool_numel
    assert int(rank_d.cpu()) == int(missed.sum()) == 7
    on_cpu = cpu_ids >= 0
    assert int(on_cpu.sum()) == n_cpu and bool((on_cpu <= missed).all())
    assert torch.equal(torch.where(on_cpu, cpu_ids, gpu_ids), flat)  # each pair on exactly one side
    assert bool((gpu_ids[on_cpu] == -1).all()) and bool((cpu_ids[~on_cpu] == -1).all())
    claimed = spare >= 0
    assert torch.equal(claimed, missed & ~on_cpu)  # the CPU's pairs claim no slot
    assert int(counter_d.cpu()) == 7 - n_cpu


@needs_native
def test_a_native_job_computes_only_the_pairs_given_to_the_cpu_and_reports_a_bad_one():
    store, gate_up, down = _store()
    cs = GraphCpuSet(native.module(), store, torch.device("cpu"), max_tokens=4, costs=_costs(store), threads=2)
    cs.open(K, torch.float32, torch.float32)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, H, generator=g), torch.softmax(torch.randn(3, K, generator=g), -1)
    ids = torch.tensor([[1, 4], [4, 6], [0, 7]])
    mine = torch.tensor([[-1, 4], [4, -1], [-1, 7]])  # the CPU's pairs
    cs.ids[1, :6] = mine.reshape(-1)
    ready = cs.launch(1, x, w)
    assert ready is None  # the simulated GPU runs it at once
    w_cpu = torch.where(mine >= 0, w, 0.0)
    ref = moe_experts(x.double(), ids, w_cpu.double(), gate_up[1].double(), down[1].double())
    torch.testing.assert_close(cs.out[:3].double(), ref, atol=1e-5, rtol=1e-4)
    sets, experts, pairs, _ = cs.sets.counters()
    assert (sets, experts, pairs) == (1, 2, 3)
    cs.ids[1, :6] = -1  # nothing for the CPU: zeros, and no set counted
    cs.launch(1, x, w)
    assert not cs.out[:3].any() and cs.sets.counters()[0] == 1
    cs.ids[1, 0] = E  # out of range: the layer's share comes back as zeros, the error waits for update
    cs.out.fill_(7.0)
    cs.launch(1, x, w)
    assert not cs.out[:3].any()
    with pytest.raises(RuntimeError, match="out of range"):
        cs.update()
    cs.update()  # taken once


def _decode(share, steps=6, n_slots=6, n_tokens=2, dtype=torch.float32):
    store, gate_up, down = _store(dtype)
    cache = ExpertCache(n_slots, H, I, dtype, torch.device(DEVICE))
    cs = GraphCpuSet(native.module(), store, torch.device(DEVICE), max_tokens=4, costs=_costs(store), threads=2)
    zc = ZeroCopyDecode(store, cache, torch.device(DEVICE), max_tokens=4, cpu_set=cs)
    assert zc.forms == ("graph", "graph-cpu", "pieces")
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        zc.before_step()
        cs.set_share(share)  # fixed here; measured CPU times move it in use
        for layer in range(L):
            x = torch.randn(n_tokens, H, generator=g).to(dtype)
            ids = torch.stack([torch.randperm(4 if step % 3 else E, generator=g)[:K] for _ in range(n_tokens)])
            w = torch.softmax(torch.randn(n_tokens, K, generator=g), -1).to(dtype)
            out = zc.run(layer, x.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), cpu=True)
            ref = moe_experts(x.double(), ids, w.double(), gate_up[layer].double().to(dtype).double(),
                              down[layer].double().to(dtype).double())
            tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(out.cpu().double(), ref, **tol)
        zc.after_step(n_tokens, cpu=True)
    zc.before_step()
    misses = cache.lru.misses
    return zc, cs, store, cache, misses


@needs_native
@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_outputs_equal_resident_with_any_cpu_share_and_only_link_reads_fill(share):
    zc, cs, store, cache, misses = _decode(share)
    t = zc.telemetry()
    cpu_pairs = t["graph_cpu_pairs"]
    assert misses > 0
    if share == 0.0:
        assert cpu_pairs == 0 and t["graph_fills"] > 0
    elif share == 1.0:  # every miss on the CPU: nothing crosses the link, nothing is filled
        assert cpu_pairs > 0 and t["graph_fills"] == 0 and t["link_bytes"] == 0 and t["zero_copy_experts"] == 0
        assert len(cache.lru) == 0
    else:
        assert cpu_pairs > 0 and t["graph_fills"] > 0 and t["link_bytes"] > 0
    assert t["zero_copy_experts"] + t["graph_cpu_experts"] >= misses  # a miss is read in place or computed


@needs_native
def test_bf16_weights_and_hidden_states_with_a_cpu_share():
    _decode(0.5, steps=3, dtype=torch.bfloat16)


@needs_native
def test_the_share_follows_the_measured_cpu_time():
    store, _, _ = _store()
    costs = _costs(store)
    cs = GraphCpuSet(native.module(), store, torch.device("cpu"), max_tokens=4, costs=costs, threads=2)
    assert float(cs.share[0]) == pytest.approx(cs.modelled_share(), rel=1e-6)
    link = costs.fill_ms()
    assert cs._share_for(link) == pytest.approx(0.5)  # as fast as the link: half the misses each
    assert cs._share_for(3 * link) == pytest.approx(0.25)
    cs.open(K, torch.float32, torch.float32)
    x, w = torch.randn(1, H), torch.full((1, K), 0.5)
    cs.ids[0, :K] = torch.tensor([2, 5])
    cs.launch(0, x, w)
    cs.update()
    assert cs.cpu_ms_per_pair is not None and cs.cpu_ms_per_pair > 0
    assert float(cs.share[0]) == pytest.approx(cs._share_for(cs.cpu_ms_per_pair), rel=1e-6)


class _Steps:
    def __init__(self, cost, forms):
        self.ch, self.now, self.forms, self.cost = ModeChooser(forms), 0.0, [], cost

    def __call__(self, n):
        for _ in range(n):
            form = self.ch.form(1)
            self.forms.append(form)
            self.ch.started(1, form, self.now)
            self.now += self.cost[form]


@pytest.mark.parametrize("cpu_ms, chosen", [(9.0, "graph-cpu"), (9.8, "graph")])
def test_the_chooser_probes_three_forms_and_takes_the_cpu_share_by_its_margin(cpu_ms, chosen):
    assert 10.0 / 9.8 < MARGINS["graph-cpu"] < 10.0 / 9.0
    forms = ("graph", "graph-cpu", "pieces")
    run = _Steps({"graph": 0.010, "graph-cpu": cpu_ms / 1e3, "pieces": 0.020}, forms)
    n = probe_length(3)
    run(n - 1)
    assert 1 not in run.ch.choice
    run(2)
    assert set(run.forms[:n]) == set(forms) and run.ch.choice[1] == chosen


def test_a_dropped_form_is_neither_probed_nor_kept():
    run = _Steps({"graph": 0.010, "graph-cpu": 0.005, "pieces": 0.020}, ("graph", "graph-cpu", "pieces"))
    run(probe_length(3) + 1)
    assert run.ch.choice[1] == "graph-cpu"
    run.ch.drop("graph-cpu")
    run(probe_length(2) + 5)
    assert run.ch.choice[1] == "graph" and "graph-cpu" not in run.forms[-(probe_length(2) + 4):]


def test_pair_accounting_counts_link_reads_apart_from_the_cpu_pairs():
    """_account with CPU pairs: an expert whose every pair the CPU computed read nothing over the link;
    one with a pair read in place did (and fills its slot)."""
    store, _, _ = _store()
    cache = ExpertCache(8, H, I, torch.float32, torch.device(DEVICE))
    zc = ZeroCopyDecode(store, cache, torch.device(DEVICE), max_tokens=4)
    zc.before_step()
    assert len(zc.spare_slots) >= 2
    log = np.full((L, 2, K), -1, dtype=np.int64)
    log[0] = [[1, 2], [1, 3]]  # layer 0: expert 1 twice, 2 and 3 once; all misses
    claims = np.full((L, 2 * K), -1, dtype=np.int64)
    cpu = np.full((L, 2 * K), -1, dtype=np.int64)
    cpu[0, [1, 2]] = [2, 1]  # the CPU took expert 2 and one of expert 1's pairs
    slot = zc.spare_slots[0]
    claims[0, 0] = slot * zc.slot_numel  # expert 1's other pair was read in place and filled
    claims[0, 3] = zc.spare_slots[1] * zc.slot_numel  # expert 3 too
    zc._account(log, claims, cpu)
    assert zc.zero_copy_experts == 2  # experts 1 and 3 crossed the link; 2 did not
    assert zc.link_blocks == 2 and zc.fills == 2 and cache.lru.misses == 3
