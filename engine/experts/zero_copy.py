"""Offloaded experts inside one decode graph: misses read in place over PCIe, the cache managed between steps.

The decode step in pieces (engine/runtime/decode_graph.py) hands every MoE layer to the host: one
sync, an LRU lookup, the plan and the launches cost the driving thread 0.3–0.6 ms per layer on the
H200 (benchmarks/RESULTS.md, 2026-11-30), more than the device work of a layer whose experts mostly
hit. PDScope (seed 001, §4.4) compiles its decisions into a static graph with zero-copy I/O instead.
Here the GPU finds each routed expert itself, through an offset table on the device, (L, E) int64:
an expert's entry points into its cache slot or into the pinned host store, which the expert kernel
(`moe_decode` with `offsets`) then reads in place over PCIe — nothing copied, nothing kept. The
whole step is one graph, and the cache follows one step behind, on the host, between replays:

1. The graph logs every MoE layer's routing; after the replay the log comes to the host.
2. Before the next replay the host reads it: experts whose entry pointed to a slot were hits (their
   LRU recency is refreshed); the others were read over PCIe (misses).
3. Fills whose copy has finished are switched on: their entries now point to their slots.
4. Misses are admitted, heaviest first, up to what the link carries in one step beside the PCIe
   reads: an LRU slot is taken, its old owner's entry points back to the store at once, and the
   block is copied on the copy stream. The new entry keeps pointing to the store until the copy
   is done (step 3 of a later boundary).
5. The changed table goes to the device on the compute stream, ahead of the next replay.

A slot is overwritten only after every replay that could read it through its old entry has finished
(the host waited for the last replay's log) and after the table that no longer points to it was
queued ahead of every later replay. A step run the other way (pieces, eager prefill) changes the LRU
behind the table's back; the table is then rebuilt from the LRU before the next graph replay.

`ModeChooser` keeps, per batch size, whichever of the two step forms (one graph here, or pieces with
the planner's CPU split) measured faster, and re-measures the other now and then.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import torch

from engine.kernels import moe_decode_gpu

PROBE_STEPS = 6  # steps timed per form before choosing (the first after a switch is not timed)
REPROBE_EVERY = 256  # steps after which the form not in use is timed again


class ZeroCopyDecode:
    def __init__(self, store, cache, device: torch.device, max_tokens: int, pcie_gbps: float, window=None):
        """window: a deque the owner keeps its (hits, lookups) per layer step in (the hit rate)."""
        self.store, self.cache, self.lru, self.device = store, cache, cache.lru, torch.device(device)
        self.max_tokens = max_tokens  # tokens a replay may carry (the log's rows)
        self.pcie_gbps = pcie_gbps  # B_P, for the fill budget
        self.window = window
        L, E = store.n_layers, store.n_experts
        elt = store.blocks.element_size()
        pool_base = cache.pool.data_ptr()
        if self.device.type == "cuda":
            from engine.hw.hostmem import device_address

            store_base = device_address(store.blocks)  # raises when the store is not mapped host memory
        else:  # the simulated GPU: host addresses throughout
            store_base = store.blocks.data_ptr()
        block_of = store.block_of  # (L, E), −1 off the MoE layers
        # element distance from the pool's first element to each expert's block in the store: (L, E)
        self.host_offsets = (store_base - pool_base) // elt + np.maximum(block_of, 0) * store.block_numel
        self.slot_numel = cache.pool.shape[1]  # P: a slot's offset is slot · P
        pinned = self.device.type == "cuda"
        self.mirror = torch.from_numpy(self.host_offsets.copy()).pin_memory() if pinned else \
            torch.from_numpy(self.host_offsets.copy())  # (L, E) the host's copy of the table
        self._mirror_np = self.mirror.numpy()
        self.table = self.mirror.to(self.device, copy=True)  # (L, E) int64, read by the graph
        self.log = self.log_host = None  # (L, max_tokens, k) routing of a replay, made at the first run
        self._log_ready = None  # CUDA event after the last replay's log copy
        self._logged_tokens = 0  # B of the log awaiting its reading
        self._pending: list[tuple[list[tuple[int, int]], list[int], object]] = []  # (keys, slots, done event)
        self.stale = True  # the LRU changed outside this path: rebuild the table before a replay
        self.zero_copy_experts = self.fills = self.steps = 0  # experts read over PCIe; blocks copied into slots
        self._last_step_s = None

    # -- inside the graph -------------------------------------------------------------------------
    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Device work only (captured): log the routing, compute every routed expert where the table
        says it is. x (N, H), ids (N, k) → (N, H)."""
        if self.log is None:  # the first call is a warm-up, outside any capture
            shape = (self.store.n_layers, self.max_tokens, ids.shape[1])
            self.log = torch.full(shape, -1, dtype=torch.int64, device=self.device)  # (L, B, k)
            self.log_host = torch.empty(shape, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self.log[layer, :ids.shape[0]].copy_(ids)
        return moe_decode_gpu.moe_decode(x, ids, weights, self.cache.gate_up, self.cache.down,
                                         offsets=self.table[layer])

    # -- between replays --------------------------------------------------------------------------
    def before_step(self, stream=None) -> None:
        """Read the last replay's routing, update the LRU, switch on finished fills, admit misses and
        upload the table: everything the next replay needs, queued ahead of it."""
        self._read_log()
        if self.stale:
            self._rebuild(stream)
        else:
            self._switch_on_finished()
        self._upload()

    def after_step(self, n_tokens: int, step_s: float | None) -> None:
        """Queue the log's copy to the host behind the replay just launched."""
        self.log_host.copy_(self.log, non_blocking=True)
        if self.device.type == "cuda":
            self._log_ready = torch.cuda.Event()
            self._log_ready.record()
        else:
            self._log_ready = _Done()
        self._logged_tokens = n_tokens
        self._last_step_s = step_s
        self.steps += 1

    def _account(self, log: np.ndarray) -> None:
        """log (L, B, k) of a finished replay: LRU hits refreshed, misses counted and admitted."""
        lru, E = self.lru, self.store.n_experts
        L = log.shape[0]
        flat = (np.arange(L)[:, None, None] * E + log).ravel()
        counts = np.bincount(flat[log.ravel() >= 0], minlength=L * E).reshape(L, E)  # tokens per (layer, expert)
        active = counts > 0
        hit = active & (self._mirror_np != self.host_offsets)  # entries that pointed to a slot
        missed = active & ~hit
        hits_per_layer, active_per_layer = hit.sum(1), active.sum(1)
        for layer in np.flatnonzero(active_per_layer).tolist():
            lru.lookup(layer, np.flatnonzero(hit[layer]).tolist())  # refresh recency (and lock)
            if self.window is not None:
                self.window.append((int(hits_per_layer[layer]), int(active_per_layer[layer])))
        n_missed = int(missed.sum())
        lru.misses += n_missed
        self.zero_copy_experts += n_missed
        layers, experts = np.nonzero(missed)
        order = np.lexsort((experts, layers, -counts[layers, experts]))  # heaviest first
        candidates = [(l, e) for l, e in zip(layers[order].tolist(), experts[order].tolist()) if (l, e) not in lru]
        lru.unlock()  # a cache smaller than one step's experts evicts this step's own, as LRU does
        budget = min(self._fill_budget(n_missed), self.cache.n_slots)  # ≤ n_slots: a victim is always free
        self._admit(candidates[:budget])
        lru.unlock()

    def _fill_budget(self, n_missed: int) -> int:
        """Fills the link carries during one step beside that step's own PCIe reads (at least one, so
        the cache always learns): step time × B_P, less the misses' bytes."""
        if self._last_step_s is None:
            return n_missed
        link_blocks = int(self._last_step_s * self.pcie_gbps * 1e9 / self.store.block_bytes)
        return max(1, link_blocks - n_missed)

    def _admit(self, keys: list[tuple[int, int]]) -> None:
        if not keys or self.cache.n_slots == 0:
            return
        slots = []
        for layer, e in keys:
            slot, evicted = self.lru.admit(layer, e)
            if evicted is not None:  # its readers from now on go to the store
                self._mirror_np[evicted] = self.host_offsets[evicted]
            slots.append(slot)
        self.cache.copy_in_many(slots, [self.store.block(layer, e) for layer, e in keys])
        self.fills += len(slots)
        done = None
        if self.cache.copy_stream is not None:
            done = torch.cuda.Event()
            done.record(self.cache.copy_stream)
        self._pending.append((keys, slots, done))

    def _switch_on_finished(self) -> None:
        still = []
        for keys, slots, done in self._pending:
            if done is not None and not done.query():
                still.append((keys, slots, done))
                continue
            for key, slot in zip(keys, slots):
                if self.lru.slot_of(key) == slot:  # not evicted again since
                    self._mirror_np[key] = slot * self.slot_numel
        self._pending = still

    def _rebuild(self, stream) -> None:
        """The table from the LRU as it stands, once every copy issued so far has landed."""
        self.cache.wait_copies(stream)  # the replay reads the slots after every fill and prefetch
        self._pending.clear()
        self._mirror_np[:] = self.host_offsets
        for (layer, e), ent in self.lru.entries.items():
            self._mirror_np[layer, e] = ent.slot * self.slot_numel
        self.stale = False

    def _upload(self) -> None:
        # From pinned pages, in stream order before the replay; the mirror is next written after
        # the next log wait, by which time this copy has run.
        self.table.copy_(self.mirror, non_blocking=True)

    def telemetry(self) -> dict:
        return {"graph_steps": self.steps, "zero_copy_experts": self.zero_copy_experts,
                "zero_copy_bytes": self.zero_copy_experts * self.store.block_bytes, "graph_fills": self.fills}

    def leave(self) -> None:
        """A step of another form follows: read the last replay's log now, and rebuild the table from
        the LRU before the next replay (the other form admits and evicts behind it)."""
        self._read_log()
        self.stale = True

    def _read_log(self) -> None:
        if self._log_ready is not None:
            self._log_ready.synchronize()  # the last replay has finished: no kernel reads a slot now
            self._log_ready = None
            self._account(self.log_host[:, :self._logged_tokens].numpy())


class _Done:
    """The simulated GPU's stand-in for a finished CUDA event."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class ModeChooser:
    """Per batch size, which step form to run: time PROBE_STEPS steps of each, keep the faster by
    median step interval, and time the other again every REPROBE_EVERY steps."""

    FORMS = ("graph", "pieces")

    def __init__(self):
        self.samples = defaultdict(list)  # (B, form) → step intervals, s
        self.choice: dict[int, str] = {}
        self.since_choice = defaultdict(int)
        self._last: tuple[int, str, float] | None = None  # (B, form, start) of the step before

    def form(self, B: int) -> str:
        chosen = self.choice.get(B)
        if chosen is not None and self.since_choice[B] < REPROBE_EVERY:
            return chosen
        for form in self.FORMS:  # probing: each form until it has its samples
            if len(self.samples[(B, form)]) < PROBE_STEPS:
                return form
        faster = min(self.FORMS, key=lambda f: float(np.median(self.samples[(B, f)])))
        self.choice[B] = faster
        self.since_choice[B] = 0
        other = self.FORMS[1 - self.FORMS.index(faster)]
        self.samples[(B, other)].clear()  # re-timed at the next probe
        self.samples[(B, faster)] = self.samples[(B, faster)][-PROBE_STEPS:]
        return faster

    def discard(self) -> None:
        """The next step's interval is not timed (a capture ran in between)."""
        self._last = None

    def started(self, B: int, form: str, now: float | None = None) -> float | None:
        """Mark a step's start; returns the interval since the last step's start when that step was of
        the same batch size and form (the step it timed), else None."""
        now = time.perf_counter() if now is None else now
        last, self._last = self._last, (B, form, now)
        if B in self.choice:
            self.since_choice[B] += 1
        if last is None or last[:2] != (B, form):
            return None
        interval = now - last[2]
        self.samples[(B, form)].append(interval)
        return interval

    def telemetry(self) -> dict:
        return {"decode_form": {str(B): f for B, f in sorted(self.choice.items())},
                "step_ms": {f"{B}:{form}": round(1e3 * float(np.median(s)), 3)
                            for (B, form), s in sorted(self.samples.items()) if s}}
