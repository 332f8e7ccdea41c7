"""Offloaded experts inside one decode graph: misses read in place over PCIe and kept on the way.

The decode step in pieces (engine/runtime/decode_graph.py) hands every MoE layer to the host: one
sync, an LRU lookup, the plan and the launches cost the driving thread 0.3–0.6 ms per layer on the
H200 (benchmarks/RESULTS.md, 2026-11-30), more than the device work of a layer whose experts mostly
hit. PDScope (seed 001, §4.4) compiles its decisions into a static graph with zero-copy I/O instead.
Here the GPU finds each routed expert itself, through an offset table on the device, (L, E) int64:
an expert's entry points into its cache slot or into the pinned host store, which the expert kernel
(`moe_decode` with `offsets`) then reads in place over PCIe. A pair that reads from the store also
claims a free slot from a list the host prepared and writes the weights it reads there: the miss is
computed and filled by one PCIe read (no second copy over the link, which halved the rate of a first
version that admitted misses by DMA beside the in-place reads: RESULTS.md, phase U). The whole step
is one graph; the cache follows one step behind, on the host, between replays:

1. The graph logs each MoE layer's routing and each pair's claimed slot; after the replay both come
   to the host.
2. Before the next replay the host reads them: experts whose entry pointed to a slot were hits
   (their LRU recency is refreshed); the others were misses, and each missed expert that claimed a
   slot enters the LRU there, its entry now pointing to that slot (the replay that wrote it is over).
3. The list of free slots is topped up for the next step — about the last step's misses — from the
   LRU's free slots, else by evicting its least recently used entries, whose table entries point back
   to the store at once.
4. The changed table and list go to the device on the compute stream, ahead of the next replay.

No replay reads a listed slot (no entry points to it) and no slot is listed while an entry points to
it, so a slot is never written while read. A step run the other way (pieces, eager prefill) changes
the LRU behind the table's back; the table is then rebuilt from the LRU before the next graph replay.

With a `GraphCpuSet` (graph_cpu_set.py) the graph can also give part of each layer's misses to the
CPU, run by host nodes inside the graph: the form "graph-cpu". `ModeChooser` keeps, per batch size,
whichever step form (the one graph, with or without that CPU share, or pieces with the planner's CPU
split) measured faster, and re-measures the others now and then.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

import numpy as np
import torch

from engine.kernels import moe_decode_gpu
from engine.kernels.cuda_streams import indexed

PROBE_STEPS = 4  # steps timed per form before choosing
# Probed forms take turns in runs of PROBE_RUN steps, and a run's first step is not timed: it pays for
# the switch (the graph's table rebuilt from the LRU after pieces changed it, once the pieces' copies
# have landed; the pieces' reading of the graph's last log). Timed step by step in turns, every graph
# step paid that: on the H200 a probe of 19.6 ms a graph step against 16.9 for pieces chose pieces,
# which then ran 11.7 ms a step where the graph ran 9.1 (48 layers, 2K, bs=1, phase CA).
PROBE_RUN = 3


def probe_length(n_forms: int) -> int:
    """Decode steps a probe of n forms takes: PROBE_STEPS timed per form in runs of PROBE_RUN − 1 timed
    steps, and one more step while the last sample is pending (a step is timed at the next one's start)."""
    return n_forms * PROBE_RUN * math.ceil(PROBE_STEPS / (PROBE_RUN - 1)) + 1


GRAPH_FORMS = ("graph", "graph-cpu")  # the step forms that replay one whole graph
MAX_PROBE_LENGTH = probe_length(len(GRAPH_FORMS) + 1)  # what a bench's warm-up must cover
REPROBE_EVERY = 256  # steps after which the form not in use is timed again
SPARE_SHARE = 4  # at most 1/SPARE_SHARE of the cache waits as free slots for the next step's misses
# Pieces must probe this much faster to be chosen over the one graph. The probe runs while the cache
# warms, which flatters pieces: the graph reads every miss over the link, pieces split misses with the
# CPU, so the graph gains most as hits rise. On the H200 (2K, bs=1, 48 layers, phase BO) a probe of
# 22.1 ms for pieces against 24.1 for the graph chose pieces, which then decoded at 18.8 ms a step
# while the graph ran 12.2 in the other rounds. Where pieces is far faster (bs=4: 65–72 against
# 128–135 ms) the margin changes nothing.
GRAPH_MARGIN = 1.15
# The CPU share inside the graph is flattered the same way (more misses while the cache warms, and
# the experts the CPU computes are not cached), less so: it runs within the graph.
CPU_GRAPH_MARGIN = 1.05
MARGINS = {"graph": 1.0, "graph-cpu": CPU_GRAPH_MARGIN, "pieces": GRAPH_MARGIN}


class ZeroCopyDecode:
    def __init__(self, store, cache, device: torch.device, max_tokens: int, window=None, cpu_set=None):
        """window: a deque the owner keeps its (hits, lookups) per layer step in (the hit rate);
        cpu_set: a GraphCpuSet, which makes the form "graph-cpu" possible."""
        self.store, self.cache, self.lru, self.device = store, cache, cache.lru, indexed(device)
        self.cpu_set = cpu_set
        self.max_tokens = max_tokens  # tokens a replay may carry (the logs' rows)
        self.window = window
        L = store.n_layers
        elt = store.blocks.element_size()
        if self.device.type == "cuda":
            from engine.hw.hostmem import device_address

            store_base = device_address(store.blocks)  # raises when the store is not mapped host memory
        else:  # the simulated GPU: host addresses throughout
            store_base = store.blocks.data_ptr()
        # element distance from the pool's first element to each expert's block in the store: (L, E)
        self.host_offsets = (store_base - cache.pool.data_ptr()) // elt + \
            np.maximum(store.block_of, 0) * store.block_numel
        self.slot_numel = cache.pool.shape[1]  # P: a slot's offset is slot · P
        self.pool_numel = cache.pool.numel()
        self.mirror = self._host(torch.from_numpy(self.host_offsets.copy()))  # (L, E) the host's copy of the table
        self.table = self.mirror.to(self.device, copy=True)  # (L, E) int64, read by the graph
        self.max_spares = max(1, cache.n_slots // SPARE_SHARE)
        self.spare_list = self._host(torch.full((self.max_spares,), -1, dtype=torch.int64))
        self.spares = self.spare_list.to(self.device, copy=True)  # (S,) offsets of free slots, -1 past the end
        self.counter = torch.zeros(1, dtype=torch.int32, device=self.device)  # free slots claimed this step
        self.spare_slots: list[int] = []  # slots held out of the LRU for the next step's misses
        self._wanted = min(self.max_spares, 2 * L)  # list length before a step has been seen
        self.log = self.claims = self.log_host = self.claims_host = None  # made at the first run
        self._log_ready = None  # CUDA event after the last replay's log copy
        self._logged_tokens = 0  # B of the logs awaiting their reading
        self._logged_cpu = False  # whether that replay gave the CPU a share (its pairs are in cpu_set.ids_host)
        self.stale = True  # the LRU changed outside this path: rebuild the table before a replay
        self.zero_copy_experts = self.fills = self.steps = 0  # experts read over PCIe; kept in a slot
        self.link_blocks = 0  # expert blocks read over PCIe: one per (token, choice) pair read in place

    @property
    def forms(self) -> tuple[str, ...]:
        """The step forms a decode step may take with this path."""
        return ("graph", "graph-cpu", "pieces") if self.cpu_set is not None else ("graph", "pieces")

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.device.type == "cuda" else t

    # -- inside the graph -------------------------------------------------------------------------
    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            cpu: bool = False) -> torch.Tensor:
        """Device work only (captured): log the routing, claim free slots for the pairs read from the
        store, compute every routed expert where the table says it is. x (N, H), ids (N, k) → (N, H).
        cpu: give the CPU its share of the layer's misses (the form "graph-cpu")."""
        N, k = ids.shape
        if self.log is None:  # the first call is a warm-up, outside any capture
            L = self.store.n_layers
            self.log = torch.full((L, self.max_tokens * k), -1, dtype=torch.int64, device=self.device)  # (L, B·k)
            self.claims = torch.full_like(self.log, -1)  # (L, B·k) offset of the slot each pair filled, or -1
            self.log_host, self.claims_host = (self._host(torch.empty_like(t, device="cpu"))
                                               for t in (self.log, self.claims))
        offsets = self.table[layer]  # (E,)
        # (N·k,) a free slot's offset per pair read from the store, written into this layer's claims row,
        # the pairs' expert ids into its log row
        cs = self.cpu_set if cpu else None
        if cs is not None:
            cs.open(k, x.dtype, weights.dtype)
        split = None if cs is None else (cs.share, cs.misses[layer:layer + 1], cs.ids[layer, :N * k], cs.gpu_ids[:N * k])
        spare = moe_decode_gpu.claim_free_slots(ids, offsets, self.spares, self.counter, self.pool_numel,
                                                out=self.claims[layer, :N * k], log=self.log[layer, :N * k], cpu=split)
        if cs is None:
            return moe_decode_gpu.moe_decode(x, ids, weights, self.cache.gate_up, self.cache.down,
                                             offsets=offsets, spare=spare)
        ready = cs.launch(layer, x, weights)  # the CPU's pairs, beside the expert kernels
        return moe_decode_gpu.moe_decode(x, cs.gpu_ids[:N * k].view(N, k), weights, self.cache.gate_up,
                                         self.cache.down, offsets=offsets, spare=spare, add=cs.out[:N],
                                         add_ready=ready)

    # -- between replays --------------------------------------------------------------------------
    def before_step(self, stream=None) -> None:
        """Read the last replay's logs, update the LRU, list free slots and upload the table:
        everything the next replay needs, queued ahead of it."""
        self._read_log()
        if self.stale:
            self._rebuild(stream)
        self._list_spares()
        # From pinned pages, in stream order before the replay; the host writes them next after the
        # next log wait, by which time these copies have run.
        self.table.copy_(self.mirror, non_blocking=True)
        self.spares.copy_(self.spare_list, non_blocking=True)
        self.counter.zero_()
        if self.cpu_set is not None:
            self.cpu_set.update()  # (raises a CPU set's failure in the last replay)
            self.cpu_set.begin_step()

    def after_step(self, n_tokens: int, cpu: bool = False) -> None:
        """Queue the logs' copy to the host behind the replay just launched (cpu: a "graph-cpu" one)."""
        self.log_host.copy_(self.log, non_blocking=True)
        self.claims_host.copy_(self.claims, non_blocking=True)
        if self.device.type == "cuda":
            self._log_ready = torch.cuda.Event()
            self._log_ready.record()
        else:
            self._log_ready = _Done()
        self._logged_tokens = n_tokens
        self._logged_cpu = cpu
        self.steps += 1

    def leave(self) -> None:
        """A step of another form follows: read the last replay's logs now, hand the listed slots back
        to the LRU, and rebuild the table from the LRU before the next replay."""
        self._read_log()
        self.lru.give_back(self.spare_slots)
        self.spare_slots = []
        self.stale = True

    def _read_log(self) -> None:
        if self._log_ready is not None:
            self._log_ready.synchronize()  # the last replay has finished: no kernel reads or writes a slot now
            self._log_ready = None
            n = self._logged_tokens
            k = self.log.shape[1] // self.max_tokens
            cpu_pairs = self.cpu_set.cpu_pairs(n) if self._logged_cpu else None
            self._account(self.log_host[:, :n * k].numpy().reshape(-1, n, k), self.claims_host[:, :n * k].numpy(),
                          cpu_pairs)

    def _account(self, log: np.ndarray, claims: np.ndarray, cpu_pairs: np.ndarray | None = None) -> None:
        """log (L, B, k) and claims (L, B·k) of a finished replay: LRU hits refreshed, misses counted,
        missed experts admitted into the slots they filled. cpu_pairs (L, B·k): the pairs the CPU
        computed (expert id, -1 for the rest), which read nothing over the link."""
        lru, E = self.lru, self.store.n_experts
        L = log.shape[0]
        ids = log.reshape(L, -1)  # (L, B·k)
        flat = (np.arange(L)[:, None] * E + ids).ravel()
        counts = np.bincount(flat[ids.ravel() >= 0], minlength=L * E).reshape(L, E)  # tokens per (layer, expert)
        active = counts > 0
        hit = active & (self.mirror.numpy() != self.host_offsets)  # entries that pointed to a slot
        hit_layers, hit_experts = np.nonzero(hit)  # layer-major: the order the replay used them in
        lru.refresh(list(zip(hit_layers.tolist(), hit_experts.tolist())))
        if self.window is not None:
            hits_per_layer, active_per_layer = hit.sum(1), active.sum(1)
            for layer in np.flatnonzero(active_per_layer).tolist():
                self.window.append((int(hits_per_layer[layer]), int(active_per_layer[layer])))
        n_missed = int((active & ~hit).sum())
        lru.misses += n_missed
        cpu_flat = cpu_only = flat[:0]
        if cpu_pairs is not None:
            on_cpu = cpu_pairs >= 0  # (L, B·k)
            cpu_flat = np.nonzero(on_cpu)[0] * E + cpu_pairs[on_cpu]  # (layer, expert) of each CPU pair
            in_place = flat[(ids.ravel() >= 0) & ~on_cpu.ravel()]
            cpu_only = np.setdiff1d(cpu_flat, in_place)  # missed experts the CPU computed every pair of
        self.zero_copy_experts += n_missed - len(cpu_only)  # experts read over the link
        layers, pairs = np.nonzero(claims >= 0)  # pairs that filled a slot, layer-major
        experts = ids[layers, pairs]
        # Two tokens that missed the same expert each filled a slot: the first copy is kept, the other
        # slot stays listed.
        _, first = np.unique(layers * E + experts, return_index=True)
        first.sort()  # admitted in the order the replay filled them
        layers, experts, offsets = layers[first], experts[first], claims[layers[first], pairs[first]]
        mirror, kept = self.mirror.numpy(), set()
        for layer, e, offset in zip(layers.tolist(), experts.tolist(), offsets.tolist()):
            slot = offset // self.slot_numel
            lru.admit_into(layer, e, slot)
            mirror[layer, e] = offset
            kept.add(slot)
        if kept:
            self.spare_slots = [s for s in self.spare_slots if s not in kept]
        self.fills += len(kept)
        outside = int(counts[active & ~hit].sum()) - len(cpu_flat)  # pairs read from the store over the link
        self.link_blocks += outside  # (a pair's fill writes what it read: nothing more crosses the link)
        self._wanted = min(self.max_spares, math.ceil(1.25 * outside) + 4)

    def _list_spares(self) -> None:
        """Top the list of free slots up to about the last step's misses (evicting LRU entries, whose
        readers go back to the store from the next replay on)."""
        short = self._wanted - len(self.spare_slots)
        if short > 0:
            slots, evicted = self.lru.take_slots(short)
            mirror = self.mirror.numpy()
            for key in evicted:
                mirror[key] = self.host_offsets[key]
            self.spare_slots.extend(slots)
        listed = self.spare_list.numpy()
        listed.fill(-1)
        listed[:len(self.spare_slots)] = np.asarray(self.spare_slots, dtype=np.int64) * self.slot_numel

    def _rebuild(self, stream) -> None:
        """The table from the LRU as it stands, once every copy issued so far has landed."""
        self.cache.wait_copies(stream)  # the replay reads the slots after every fill and prefetch
        mirror = self.mirror.numpy()
        mirror[:] = self.host_offsets
        if len(self.lru):
            keys = np.array(list(self.lru.entries), dtype=np.int64)  # (n, 2) layer, expert
            slots = np.fromiter((ent.slot for ent in self.lru.entries.values()), np.int64, len(keys))
            mirror[keys[:, 0], keys[:, 1]] = slots * self.slot_numel
        self.stale = False

    def telemetry(self) -> dict:
        return {"graph_steps": self.steps, "zero_copy_experts": self.zero_copy_experts,
                "link_bytes": self.link_blocks * self.store.block_bytes, "graph_fills": self.fills,
                "free_slots_listed": len(self.spare_slots),
                **(self.cpu_set.telemetry() if self.cpu_set is not None else {})}


class _Done:
    """The simulated GPU's stand-in for a finished CUDA event."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class ModeChooser:
    """Per batch size, which step form to run: time PROBE_STEPS steps of each, the forms taking turns in
    short runs so that all see the cache as it warms (a run's first step, after the switch, untimed),
    keep the fastest by median step time × its margin (MARGINS), and time all again every
    REPROBE_EVERY steps."""

    def __init__(self, forms: tuple[str, ...] = ("graph", "pieces")):
        self.forms = tuple(forms)
        self.probe_length = probe_length(len(self.forms))
        self.samples = defaultdict(list)  # (B, form) → step durations of the current probe, s
        self.measured: dict[tuple[int, str], float] = {}  # (B, form) → median ms at the last choice
        self.choice: dict[int, str] = {}
        self.since_choice = defaultdict(int)
        self._last: tuple[int, str, float, bool] | None = None  # (B, form, start, first of a run) of the step before
        self._run: dict[int, tuple[str, int]] = {}  # B → (form, steps so far) of the probe's current run

    def probing(self, B: int) -> bool:
        return B not in self.choice or self.since_choice[B] >= REPROBE_EVERY

    def form(self, B: int) -> str:
        if not self.probing(B):
            return self.choice[B]
        counts = {f: len(self.samples[(B, f)]) for f in self.forms}
        run_form, run_steps = self._run.get(B, (None, PROBE_RUN))
        if run_steps < PROBE_RUN and counts[run_form] < PROBE_STEPS:
            self._run[B] = (run_form, run_steps + 1)
            return run_form
        if min(counts.values()) < PROBE_STEPS:
            form = min(self.forms, key=counts.get)  # the form with fewest samples (ties: the first)
            self._run[B] = (form, 1)
            return form
        self._run.pop(B, None)
        medians = {f: float(np.median(self.samples[(B, f)])) for f in self.forms}
        for f in self.forms:
            self.measured[(B, f)] = round(1e3 * medians[f], 3)
            self.samples[(B, f)].clear()
        self.choice[B] = min(self.forms, key=lambda f: medians[f] * MARGINS.get(f, 1.0))
        self.since_choice[B] = 0
        return self.choice[B]

    def drop(self, form: str) -> None:
        """Never choose or probe `form` again (its capture failed)."""
        self.forms = tuple(f for f in self.forms if f != form)
        self.probe_length = probe_length(len(self.forms))
        for B in [B for B, f in self.choice.items() if f == form]:
            del self.choice[B]  # probe again among the others
        self._run = {B: run for B, run in self._run.items() if run[0] != form}

    def discard(self) -> None:
        """The step before is not timed (a capture ran since it started)."""
        self._last = None

    def started(self, B: int, form: str, now: float | None = None) -> float | None:
        """Mark a step's start. The time since the last step's start is that step's duration; while
        probing it counts for that step's form (same batch size only). Returns it, or None."""
        now = time.perf_counter() if now is None else now
        first_of_run = self._run.get(B) == (form, 1)
        last, self._last = self._last, (B, form, now, first_of_run)
        if B in self.choice:
            self.since_choice[B] += 1
        if last is None or last[0] != B:
            return None
        duration = now - last[2]
        if self.probing(B) and not last[3]:
            self.samples[(B, last[1])].append(duration)
        return duration

    def telemetry(self) -> dict:
        return {"decode_form": {str(B): f for B, f in sorted(self.choice.items())},
                "step_ms": {f"{B}:{form}": ms for (B, form), ms in sorted(self.measured.items())}}
