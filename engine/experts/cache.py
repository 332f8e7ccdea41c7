"""The GPU expert cache: a fixed pool of slots shared by all layers, least-recently-used (seed 004).

`SlotLRU` is the bookkeeping, keyed (layer, expert): a hit refreshes recency, a fill admits into a
free slot or evicts the least recently used entry, a prefetch admits only into a free slot or one
whose entry went unused for a whole forward pass. Entries the current layer computes with are
locked until the layer ends, so neither its own fills nor the next layer's prefetches overwrite a
slot a kernel still reads. One set of primitives (refresh, lock, take_free, oldest, evict,
admit_into, give_back) does all of it: the per-layer path's lookup, admit, admit_prefetch and place
are compositions of them, and the one-graph step (engine/experts/zero_copy.py) composes its own.

`ExpertCache` owns the slots: one (n_slots, P) tensor allocated once, where a slot holds one
expert's block exactly as the host store lays it out, so a fill is one contiguous copy, issued on its
own copy stream, and nothing is allocated after construction. A store of tensors gives slots of P
elements [gate_up (2I·H) | down (H·I)] in the engine dtype; a quantised store gives slots of its
block bytes as the file has them (uint8; engine/experts/store.py `QuantLayout`), which the GPU
kernels read in place (engine/kernels/quant_moe_gpu.py), so a slot costs the file's bytes, not 3.5×
them in BF16, and a fill moves them with no work on the device.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice

import torch

from engine.errors import OutOfMemoryError
from engine.kernels.cuda_streams import Switch, indexed

Key = tuple[int, int]  # (layer, expert)


@dataclass
class _Entry:
    slot: int
    tick: int  # clock value of the last use (hit, fill or prefetch)
    prefetched: bool = False  # admitted by a prefetch and not hit since


class SlotLRU:
    def __init__(self, n_slots: int):
        if n_slots < 0:
            raise ValueError("n_slots must be ≥ 0")
        self.n_slots = n_slots
        self.entries: OrderedDict[Key, _Entry] = OrderedDict()  # least recently used first
        self.free = list(range(n_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.locked: set[Key] = set()
        self.clock = 0
        self.hits = self.misses = self.fills = self.evictions = 0
        self.prefetches = self.prefetch_used = self.prefetch_wasted = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def order(self) -> list[Key]:
        """Keys from least to most recently used."""
        return list(self.entries)

    def slot_of(self, key: Key) -> int | None:
        ent = self.entries.get(key)
        return None if ent is None else ent.slot

    # -- primitives: what both offloaded decode paths use (the one-graph step calls them itself) --------

    def refresh(self, keys: list[Key]) -> None:
        """Hits in the order they were used: recency refreshed and counted, nothing locked. The
        one-graph step reports a whole step's hits at once (~400 at bs=1 on Qwen3-30B-A3B); every key
        must be cached."""
        entries, clock = self.entries, self.clock
        for key in keys:
            ent = entries[key]
            entries.move_to_end(key)
            clock += 1
            ent.tick = clock
            if ent.prefetched:
                ent.prefetched = False
                self.prefetch_used += 1
        self.clock = clock
        self.hits += len(keys)

    def lock(self, keys) -> None:
        """Entries the current layer computes with: no eviction takes them until `unlock`."""
        self.locked.update(keys)

    def unlock(self) -> None:
        self.locked.clear()

    def take_free(self, n: int) -> list[int]:
        """Up to n free slots out of the LRU's hands. The caller holds them until it admits into them
        (`admit_into`) or gives them back (`give_back`)."""
        return [self.free.pop() for _ in range(min(n, len(self.free)))]

    def oldest(self, n: int, exclude=(), stale_before: int | None = None) -> list[Key]:
        """The n least recently used unlocked entries not in `exclude`, oldest first (left cached); with
        stale_before, only from those last used before that clock value (the search ends at the first
        entry used since, locked or not)."""
        def candidates():
            for key, ent in self.entries.items():
                if stale_before is not None and ent.tick >= stale_before:
                    return
                if key not in self.locked and key not in exclude:
                    yield key

        # Only as far into the LRU order as needed: listing every unlocked entry costs ~0.4 ms a call
        # at 2,202 slots, between two one-graph steps.
        return list(islice(candidates(), max(0, n)))

    def evict(self, key: Key) -> int:
        """Drop a cached entry whose slot the caller takes over → that slot (counted as an eviction)."""
        ent = self.entries.pop(key)
        if ent.prefetched:
            self.prefetch_wasted += 1
        self.evictions += 1
        return ent.slot

    def admit_into(self, layer: int, expert: int, slot: int, kind: str = "fill") -> None:
        """An expert now in a slot the caller took (`take_free`, or `evict`): a new, most recent entry.
        kind: "fill" (counted as a fill), "prefetch" (counted; marked until its first hit) or "placed"
        (the warm-up at load: not counted)."""
        key = (layer, expert)
        if key in self.entries:
            raise KeyError(f"expert {key} is cached already")
        self.entries[key] = _Entry(slot, self._tick(), prefetched=kind == "prefetch")
        if kind == "fill":
            self.fills += 1
        elif kind == "prefetch":
            self.prefetches += 1

    def give_back(self, slots: list[int]) -> None:
        self.free.extend(slots)

    # -- the per-layer path's steps, each a composition of the primitives ---------------------------

    def lookup(self, layer: int, experts: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Hits refresh recency and are locked for this layer → (hit experts, their slots, misses)."""
        hits, slots, misses, keys = [], [], [], []
        for e in experts:
            ent = self.entries.get((layer, e))
            if ent is None:
                misses.append(e)
                continue
            hits.append(e)
            slots.append(ent.slot)
            keys.append((layer, e))
        self.refresh(keys)
        self.lock(keys)
        self.misses += len(misses)
        return hits, slots, misses

    def admit(self, layer: int, expert: int) -> tuple[int, Key | None]:
        """A fill for this layer: a free slot, else the least recently used unlocked entry's; the entry
        is locked for the layer. Returns (slot, evicted key or None)."""
        if (layer, expert) in self.entries:
            raise KeyError(f"expert {(layer, expert)} is cached already")
        slots, evicted = self.take_free(1), None
        if not slots:
            victims = self.oldest(1)
            if not victims:
                raise RuntimeError(f"all {self.n_slots} slots are in use by this layer; the planner must cap fills")
            evicted = victims[0]
            slots = [self.evict(evicted)]
        self.admit_into(layer, expert, slots[0])
        self.lock([(layer, expert)])
        return slots[0], evicted

    def admit_prefetch(self, layer: int, expert: int, stale_before: int, protect: set[Key]) -> int | None:
        """A prefetch: a free slot, or the slot of the least recently used entry that is neither
        locked nor protected and was last used before `stale_before`; None when there is none."""
        if (layer, expert) in self.entries:
            return None
        slots = self.take_free(1)
        if not slots:
            victims = self.oldest(1, exclude=protect, stale_before=stale_before)
            if not victims:
                return None
            slots = [self.evict(victims[0])]
        self.admit_into(layer, expert, slots[0], kind="prefetch")
        return slots[0]

    def place(self, layer: int, expert: int) -> int | None:
        """Warm-up at load (hot table, static placement): a free slot or nothing; no eviction."""
        if (layer, expert) in self.entries:
            return None
        slots = self.take_free(1)
        if slots:
            self.admit_into(layer, expert, slots[0], kind="placed")
        return slots[0] if slots else None


class ExpertCache:
    """The slot pool on the compute device, with the LRU over it and a copy stream for fills."""

    def __init__(self, n_slots: int, hidden: int, expert_ffn: int, dtype: torch.dtype, device: torch.device,
                 block_bytes: int = 0):
        """block_bytes: a quantised store's block bytes (its longest layer's): the slots then hold
        those bytes (uint8) and have no tensor views; 0: slots of 3·I·H elements of `dtype`."""
        self.lru = SlotLRU(n_slots)
        self.hidden, self.expert_ffn = hidden, expert_ffn
        self.device = indexed(device)
        self.quantised = block_bytes > 0
        block = block_bytes if self.quantised else 3 * hidden * expert_ffn  # bytes, or elements
        try:
            self.pool = torch.empty((n_slots, block), dtype=torch.uint8 if self.quantised else dtype,
                                    device=self.device)  # (S, P), the only allocation
        except torch.OutOfMemoryError as e:
            raise OutOfMemoryError(f"cannot allocate {n_slots} expert slots on {self.device}",
                                   "lower vram_budget_gb or expert_cache_slots") from e
        self.allocations = 1  # slot allocations ever made; stays 1 (tests check it)
        # Views over the pool, never copies: (S, 2I, H) and (S, H, I), slot-major like the store.
        self.gate_up = self.down = None
        if not self.quantised:
            split = 2 * expert_ffn * hidden
            self.gate_up = self.pool[:, :split].unflatten(1, (2 * expert_ffn, hidden))
            self.down = self.pool[:, split:].unflatten(1, (hidden, expert_ffn))
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Recorded after the copies issued so far, each time a stream must wait for them (one event
        # reused: Stream.wait_stream creates a new one per call).
        self._copies_done = torch.cuda.Event() if self.copy_stream is not None else None

    @property
    def n_slots(self) -> int:
        return self.lru.n_slots

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    @property
    def slot_bytes(self) -> int:
        return self.pool.shape[1] * self.pool.element_size()

    def copy_in(self, slot: int, block: torch.Tensor) -> None:
        """One expert's host block (P,) into a slot: async on the copy stream from pinned memory;
        a plain copy when the "GPU" is the CPU (simulated hybrid)."""
        self.copy_in_many([slot], [block])

    def copy_in_many(self, slots: list[int], blocks: list[torch.Tensor]) -> None:
        """Several blocks into their slots, in order, entering the copy stream once (a quantised
        block's bytes land as they are: its slot is read in place)."""
        if not slots:
            return
        if self.copy_stream is None:
            for slot, block in zip(slots, blocks):
                self.pool[slot].copy_(block)
            return
        with Switch(self.copy_stream, torch.cuda.current_stream(self.device)):
            for slot, block in zip(slots, blocks):
                self.pool[slot].copy_(block, non_blocking=True)

    def wait_copies(self, stream=None) -> None:
        """Make the compute stream (the current one unless given) wait for every fill and prefetch
        issued so far."""
        if self.copy_stream is not None:
            self._copies_done.record(self.copy_stream)
            (stream or torch.cuda.current_stream(self.device)).wait_event(self._copies_done)

    def synchronize(self) -> None:
        if self.copy_stream is not None:
            self.copy_stream.synchronize()


def slots_for_budget(budget_bytes: int, used_bytes: int, slot_bytes: int, reserve_bytes: int) -> int:
    """Expert slots that fit in a device budget after the dense weights and KV (`used_bytes`) and a
    reserve for activations and workspace."""
    free = budget_bytes - used_bytes - reserve_bytes
    if free < slot_bytes:
        raise OutOfMemoryError(
            f"the VRAM budget ({budget_bytes / 2**30:.2f} GiB) leaves no room for one expert slot "
            f"({slot_bytes / 2**20:.1f} MiB) after dense weights and KV ({used_bytes / 2**30:.2f} GiB) "
            f"and a {reserve_bytes / 2**30:.2f} GiB reserve",
            "raise vram_budget_gb, lower max_context or max_batch, or use expert_policy cpu-only")
    return free // slot_bytes
