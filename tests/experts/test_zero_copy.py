"""The whole-step decode path of offloaded experts (engine/experts/zero_copy.py), driven step by step
as DecodeGraphs drives it, on the CPU (the expert kernel through Triton's interpreter) and on the
GPU where CUDA exists: outputs equal resident execution while the table, the LRU and the fills change
between steps; the cache learns the misses; a table rebuilt after the other path matches the LRU."""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from engine.experts.cache import ExpertCache  # noqa: E402
from engine.experts.store import ExpertStore  # noqa: E402
from engine.experts.zero_copy import PROBE_STEPS, REPROBE_EVERY, ModeChooser, ZeroCopyDecode  # noqa: E402
from engine.kernels.experts_torch import moe_experts  # noqa: E402

L, E, H, I, K = 3, 6, 24, 16, 2
# the kernel runs compiled on CUDA tensors, or interpreted on CPU tensors where there is no GPU
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = [torch.randn(E, 2 * I, H, generator=g) / H**0.5 for _ in range(L)]
    down = [torch.randn(E, H, I, generator=g) / I**0.5 for _ in range(L)]
    return gate_up, down


def _decode(device, n_slots, steps, n_tokens=2, seed=1):
    gate_up, down = _model()
    store = ExpertStore.from_layers(gate_up, down, dtype=torch.float32, pin=device == "cuda")
    cache = ExpertCache(n_slots, H, I, torch.float32, torch.device(device))
    window = []
    zc = ZeroCopyDecode(store, cache, torch.device(device), max_tokens=4, pcie_gbps=50.0, window=window)
    g = torch.Generator().manual_seed(seed)
    experts_per_step = []
    for step in range(steps):
        zc.before_step()
        used = set()
        for layer in range(L):
            x = torch.randn(n_tokens, H, generator=g)
            # a few popular experts so that the cache has something to learn
            ids = torch.stack([torch.randperm(3 if step % 4 else E, generator=g)[:K] for _ in range(n_tokens)])
            w = torch.softmax(torch.randn(n_tokens, K, generator=g), -1)
            out = zc.run(layer, x.to(device), ids.to(device), w.to(device))
            ref = moe_experts(x.double(), ids, w.double(), gate_up[layer].double(), down[layer].double())
            torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-4)
            used |= {(layer, int(e)) for e in ids.unique()}
        zc.after_step(n_tokens, step_s=None)
        experts_per_step.append(used)
    zc.before_step()  # reads the last step's log
    return zc, store, cache, window, experts_per_step


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_slots", [1, 4, L * E])
def test_outputs_equal_resident_while_the_cache_changes(device, n_slots):
    zc, store, cache, window, used = _decode(device, n_slots, steps=9)
    lru = cache.lru
    t = zc.telemetry()
    lookups = sum(len(u) for u in used)
    assert lru.hits + lru.misses == lookups  # each (layer, expert) of a step counted once
    assert t["zero_copy_experts"] == lru.misses > 0
    assert t["graph_fills"] == lru.fills > 0 and len(lru) <= n_slots
    assert sum(n for _, n in window) == lookups and sum(h for h, _ in window) == lru.hits
    if n_slots == L * E:  # everything fits: after the first sight every expert hits
        seen = set().union(*used)
        assert lru.misses == len(seen) and lru.evictions == 0


@pytest.mark.parametrize("device", DEVICES)
def test_table_points_to_slots_of_cached_experts_and_to_the_store_otherwise(device):
    zc, store, cache, _, _ = _decode(device, 4, steps=5)
    table = zc.table.cpu().numpy()
    if device == "cuda":
        torch.cuda.synchronize()
    cached = {key: ent.slot for key, ent in cache.lru.entries.items()}
    for layer in store.layers:
        for e in range(E):
            slot = cached.get((layer, e))
            want = zc.host_offsets[layer, e] if slot is None else slot * zc.slot_numel
            if slot is not None and (layer, e) not in {k for keys, _, _ in zc._pending for k in keys}:
                assert table[layer, e] == want, (layer, e)
            elif slot is None:
                assert table[layer, e] == want, (layer, e)
    # the other path changed the LRU: a rebuild makes the table the LRU's again
    cache.lru.admit(0, 5) if (0, 5) not in cache.lru else None
    cache.lru.unlock()
    zc.stale = True
    zc.before_step()
    if device == "cuda":
        torch.cuda.synchronize()
    table = zc.table.cpu().numpy()
    for (layer, e), ent in cache.lru.entries.items():
        assert table[layer, e] == ent.slot * zc.slot_numel
    assert not zc.stale


def test_fill_budget_follows_the_link_time_of_a_step():
    zc, store, *_ = _decode(DEVICES[0], 4, steps=1)
    assert zc._fill_budget(7) == 7  # before any step was timed: every miss
    zc._last_step_s = 10 * store.block_bytes / 50e9  # a step long enough for 10 blocks over the link
    assert zc._fill_budget(4) == 6 and zc._fill_budget(30) == 1  # at least one: the cache keeps learning


def test_mode_chooser_times_both_forms_then_keeps_the_faster():
    ch = ModeChooser()
    cost = {"graph": 0.010, "pieces": 0.030}
    now, forms = 0.0, []
    for _ in range(2 * (PROBE_STEPS + 1) + 10):
        form = ch.form(1)
        forms.append(form)
        ch.started(1, form, now)
        now += cost[form]
    assert forms[:PROBE_STEPS + 1] == ["graph"] * (PROBE_STEPS + 1)  # the first interval of a form is untimed
    assert "pieces" in forms and forms[-1] == "graph" and ch.choice[1] == "graph"
    # the other form is timed again after REPROBE_EVERY steps, and wins if it became faster
    cost["pieces"] = 0.005
    for _ in range(REPROBE_EVERY + 2 * PROBE_STEPS + 4):
        form = ch.form(1)
        ch.started(1, form, now)
        now += cost[form]
    assert ch.choice[1] == "pieces"
    ch.discard()
    assert ch.started(1, "pieces", now + 5.0) is None  # a capture in between is not a step
