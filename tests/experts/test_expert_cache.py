"""The slot LRU on scripted access sequences, the slot pool, and budget sizing."""

import pytest
import torch

from engine.errors import OutOfMemoryError
from engine.experts.cache import ExpertCache, SlotLRU, slots_for_budget


def step(lru: SlotLRU, layer: int, experts: list[int]) -> tuple[list[int], list[int]]:
    """One layer as the executor does it: look up, fill every miss, unlock → (hits, misses)."""
    hits, _, misses = lru.lookup(layer, experts)
    for e in misses:
        lru.admit(layer, e)
    lru.unlock()
    return hits, misses


def test_scripted_sequence_hits_refresh_fills_evict_the_least_recently_used():
    lru = SlotLRU(3)
    assert step(lru, 0, [1, 2]) == ([], [1, 2])
    assert [lru.slot_of((0, 1)), lru.slot_of((0, 2))] == [0, 1]  # free slots in order
    assert step(lru, 1, [1]) == ([], [1])
    assert lru.order() == [(0, 1), (0, 2), (1, 1)]
    assert step(lru, 0, [2]) == ([2], [])  # a hit moves (0,2) to the most recent end
    assert lru.order() == [(0, 1), (1, 1), (0, 2)]
    assert step(lru, 1, [5]) == ([], [5])  # full: evicts the LRU (0,1) and takes its slot
    assert lru.order() == [(1, 1), (0, 2), (1, 5)]
    assert lru.slot_of((1, 5)) == 0 and (0, 1) not in lru
    assert step(lru, 0, [1, 2]) == ([2], [1])  # (0,2) hit first, then (0,1) evicts (1,1)
    assert lru.order() == [(1, 5), (0, 2), (0, 1)]
    assert (lru.hits, lru.misses, lru.fills, lru.evictions) == (2, 5, 5, 2)


def test_fills_never_evict_what_the_current_layer_uses():
    lru = SlotLRU(2)
    step(lru, 0, [0])
    step(lru, 1, [0])
    hits, slots, misses = lru.lookup(1, [0, 3])  # (1,0) is locked now; (0,0) is the LRU
    slot, evicted = lru.admit(1, 3)
    assert evicted == (0, 0) and slot == lru.slot_of((1, 3))
    with pytest.raises(RuntimeError, match="in use by this layer"):
        lru.admit(1, 4)  # both slots hold this layer's experts
    lru.unlock()
    assert lru.admit(2, 4)[1] == (1, 0)


def test_one_slot_cache_cycles():
    lru = SlotLRU(1)
    for layer in range(4):
        assert step(lru, layer, [layer % 2]) == ([], [layer % 2])
    assert lru.order() == [(3, 1)] and lru.evictions == 3


def test_prefetch_takes_only_free_or_stale_slots_and_counts_use_and_waste():
    lru = SlotLRU(3)
    assert lru.admit_prefetch(0, 4, stale_before=0, protect=set()) == 0  # free slot
    step(lru, 0, [1])
    step(lru, 0, [2])
    tick_now = lru.clock + 1
    # full; ticks are (0,4):1 (0,1):2 (0,2):3 and nothing was used before `stale_before` = 1
    assert lru.admit_prefetch(1, 7, stale_before=1, protect=set()) is None
    # with a later horizon the LRU entry (0,4) (prefetched, never used) goes and counts as wasted
    slot = lru.admit_prefetch(1, 7, stale_before=tick_now, protect={(0, 1)})
    assert slot == 0 and (0, 4) not in lru and lru.prefetch_wasted == 1
    # protected and locked entries are skipped: (0,1) and (1,7) are protected, (0,2) is locked
    lru.lookup(0, [2])
    assert lru.admit_prefetch(2, 0, stale_before=lru.clock + 1, protect={(0, 1), (1, 7)}) is None
    lru.unlock()
    assert step(lru, 1, [7]) == ([7], []) and lru.prefetch_used == 1
    assert lru.prefetches == 2


def test_refresh_counts_hits_in_the_order_given_and_locks_nothing():
    """The one-graph step reports a whole step's hits at once (zero_copy._account)."""
    lru = SlotLRU(4)
    step(lru, 0, [1, 2, 3])
    assert lru.admit_prefetch(1, 5, stale_before=0, protect=set()) == 3
    lru.refresh([(1, 5), (0, 1)])
    assert lru.order() == [(0, 2), (0, 3), (1, 5), (0, 1)]
    assert lru.entries[(0, 1)].tick == lru.clock and lru.entries[(1, 5)].tick == lru.clock - 1
    assert (lru.hits, lru.prefetch_used, lru.locked) == (2, 1, set())
    with pytest.raises(KeyError):
        lru.refresh([(2, 2)])  # not cached: the caller's table and the LRU disagree


def test_the_oldest_unlocked_entries_are_listed_and_evicted_when_their_slots_are_taken():
    lru = SlotLRU(4)
    step(lru, 0, [0, 1, 2, 3])
    lru.lookup(0, [0])  # (0,0) is locked and most recent now
    evicted = lru.oldest(2)
    slots = [lru.evict(key) for key in evicted]
    assert evicted == [(0, 1), (0, 2)] and slots == [1, 2]
    assert lru.take_free(5) == [] and lru.oldest(5) == [(0, 3)]  # only the locked entry is left besides
    assert lru.evict((0, 3)) == 3
    lru.unlock()
    lru.give_back(slots)
    assert sorted(lru.free) == [1, 2] and lru.order() == [(0, 0)]
    assert lru.take_free(5) == [2, 1] and lru.free == []  # free slots leave in the order admit takes them


def test_oldest_stops_at_the_first_entry_used_since_the_clock_given():
    """The prefetch's rule, as a primitive: entries last used at or after stale_before end the search,
    locked ones included; locked and excluded entries before it are passed over."""
    lru = SlotLRU(4)
    step(lru, 0, [0, 1, 2, 3])  # ticks 1 … 4, oldest first
    lru.lock([(0, 0)])
    assert lru.oldest(3, stale_before=4) == [(0, 1), (0, 2)]  # (0,0) locked, (0,3) used at 4
    assert lru.oldest(3, exclude={(0, 1)}, stale_before=3) == []  # (0,2) was used at 3: the search ends
    assert lru.oldest(1, stale_before=1) == []


def test_admit_into_counts_by_kind():
    lru = SlotLRU(3)
    slots = lru.take_free(3)
    for (e, kind), slot in zip([(0, "fill"), (1, "prefetch"), (2, "placed")], slots):
        lru.admit_into(0, e, slot, kind=kind)
    assert (lru.fills, lru.prefetches) == (1, 1)
    assert [lru.entries[(0, e)].prefetched for e in range(3)] == [False, True, False]
    with pytest.raises(KeyError):
        lru.admit_into(0, 1, 0)  # cached already


def test_warm_placement_fills_free_slots_only():
    lru = SlotLRU(2)
    assert [lru.place(0, e) for e in range(3)] == [0, 1, None]
    assert lru.evictions == 0 and lru.fills == 0


def test_slot_pool_is_allocated_once_and_fills_copy_blocks():
    H, I = 8, 4
    cache = ExpertCache(3, H, I, torch.float32, torch.device("cpu"))
    ptr = cache.pool.data_ptr()
    block = torch.arange(3 * H * I, dtype=torch.float32)
    cache.copy_in(2, block)
    assert torch.equal(cache.pool[2], block)
    assert torch.equal(cache.gate_up[2], block[:2 * I * H].view(2 * I, H))
    assert torch.equal(cache.down[2], block[2 * I * H:].view(H, I))
    assert cache.gate_up.data_ptr() == ptr and cache.allocations == 1
    assert cache.nbytes == 3 * 3 * H * I * 4 and cache.slot_bytes == 3 * H * I * 4


def test_slots_for_budget():
    gib = 2**30
    assert slots_for_budget(24 * gib, 6 * gib, 9_437_184, gib) == (17 * gib) // 9_437_184
    with pytest.raises(OutOfMemoryError, match="no room for one expert slot"):
        slots_for_budget(4 * gib, 4 * gib, 9_437_184, 0)
