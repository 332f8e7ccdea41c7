"""Offloaded experts inside one decode graph: misses read in place over PCIe and kept on the way.

The decode step in pieces (engine/runtime/decode_graph.py) hands every MoE layer to the host: one
sync, an LRU lookup, the plan and the launches cost the driving thread 0.3–0.6 ms per layer on a
server host, more than the device work of a layer whose experts mostly hit. PDScope (seed 001,
§4.4) compiles its decisions into a static graph with zero-copy I/O instead. Here the GPU finds each routed expert itself, through an offset table on the device, (L, E) int64:
an expert's entry points into its cache slot or into the pinned host store, which the expert kernel
(`moe_decode` with `offsets`; for a quantised store `moe_decode_quant`, every offset in bytes, the
blocks read as the file has them) then reads in place over PCIe. A pair that reads from the store also
claims a free slot from a list the host prepared and writes the weights it reads there: the miss is
computed and filled by one PCIe read (a second copy over the link, a DMA beside the in-place read,
would halve the rate at which misses are served). The whole step is one graph; the host's LRU
follows behind it, between replays:

1. The graph logs each MoE layer's routing and each pair's claimed slot; after the replay both come
   to the host. The device's table keeps itself meanwhile: the sum kernel points each filled expert
   at its slot (the first pair's, where two tokens missed it), the claim kernel points a victim back
   to the store (below).
2. The host reads a step's logs while the next step runs: experts whose entry pointed to a slot when
   their layer ran were hits (their LRU recency is refreshed); the others were misses. A listed slot
   that was claimed loses its old expert, and each missed expert that claimed a slot enters the LRU
   there, as the device already has it.
3. The list of slots for a step's misses — about the last step's — starts with the LRU's free slots
   (held out of it) and goes on with the slots of its least recently used entries, which stay
   cached: each is listed with its victim, the entry it holds. Victims listed for the step in flight
   are left out (their slots may be taken already). Where a list is a large share of the cache, the
   host reads the step in flight first (LAG_LIST_SHARE).
4. The list goes to the device on the compute stream, ahead of the replay; pinned staging buffers
   alternate between steps, so that a step's list is written while the one before is in flight.

A pair that claims a victim's slot first points the victim's table entry back to the store, in the
claim kernel, before any expert kernel of its layer reads the table: the victim's later layers in
the step read it from the store, its earlier ones have finished. So a slot is never written while
read, and a victim stays cached until a miss really takes its slot. (Evicting the listed entries
ahead would hold ~1.25 × a step's misses of the cache empty: at 32K bs=1 with 916 slots about 190,
enough to drop the hit rate from 0.66 to 0.61.)
A step run the other way (pieces, eager prefill) changes the LRU behind the table's back; the table
is then rebuilt from the LRU before the next graph replay.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from engine.experts.cpu_mailbox import CpuMailbox, MissSplit
from engine.kernels import moe_decode_gpu, quant_moe_gpu
from engine.kernels.cuda_streams import indexed

# At most 1/SPARE_SHARE of the cache waits as free slots for the next step's misses: a churning step
# misses well under a quarter of the slots (13-17%), and a slot held free holds no hit.
SPARE_SHARE = 4
# The host lists a step's slots while the step before runs (it reads that step's log afterwards) only
# where a list is at most this share of the cache. Running ahead hides the host's work, but the
# slots listed for the step in flight are out of reach of the next list and the LRU order is a step
# old. With 48 layers at bs=1 on an H200: at 2K (2,267 slots, ~28 listed) running ahead decodes 111
# tok/s against 101-103 waiting for the log; at 32K with 916 slots (~170 listed) it hits 0.630 against
# 0.650 and runs 28.8 against 29.4. There the host reads the last step's log first.
LAG_LIST_SHARE = 0.05


class ZeroCopyDecode:
    def __init__(self, store, cache, device: torch.device, max_tokens: int, window=None,
                 lag_list_share: float = LAG_LIST_SHARE, cpu_split: MissSplit | None = None):
        """window: a deque the owner keeps its (hits, lookups) per layer step in (the hit rate).
        lag_list_share: the list's largest share of the cache at which the host lists a step's slots
        without reading the step before's log (LAG_LIST_SHARE; 0: never, 1: always). cpu_split: the
        costs by which each layer's misses split between the link and the CPU's mailbox (cpu_mailbox.py;
        None: no CPU, every miss is read over PCIe)."""
        self.store, self.cache, self.lru, self.device = store, cache, cache.lru, indexed(device)
        self.lag_list_share = lag_list_share
        # Opened at the first run, once top-k is known; from then on every layer's kernels post to it
        # (a layer whose split gives the CPU nothing posts nothing). Where every expert has a slot
        # nothing can miss, and the graph has no mailbox kernels.
        self.mailbox: CpuMailbox | None = None
        self.mailbox_failed: str | None = None  # why it could not open
        self.cpu_split = cpu_split
        self.mailbox_off: str | None = (  # why there is none
            "no CPU split" if cpu_split is None else
            "every expert has a slot" if cache.n_slots >= store.n_routed else None)
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
        # Two of each pinned staging buffer, taken by alternate steps: a step's lists and logs are
        # written while the step before is still in flight.
        self.lists_host = [(self._host(torch.full((self.max_spares,), -1, dtype=torch.int64)),
                            self._host(torch.full((self.max_spares,), -1, dtype=torch.int64))) for _ in range(2)]
        self.spares = self.lists_host[0][0].to(self.device, copy=True)  # (S,) offsets of listed slots, -1 past the end
        self.victims = self.lists_host[0][1].to(self.device, copy=True)  # (S,) layer · E + expert a listed slot holds, or -1
        self.host_table = torch.from_numpy(self.host_offsets.reshape(-1).copy()).to(self.device)  # (L·E,) store offsets
        self.counter = torch.zeros(1, dtype=torch.int32, device=self.device)  # listed slots claimed this step
        self._wanted = min(self.max_spares, 2 * L)  # list length before a step has been seen
        self.log = self.claims = self.cpu_log = None  # (L, B·k) on the device, made at the first run
        self.logs_host: list[tuple[torch.Tensor, ...]] = []  # two (log, claims, cpu_log) pinned copies
        self._next: _Listed | None = None  # the slots listed for the step about to run
        self._inflight: deque[_Listed] = deque()  # steps run whose logs the host has not read, oldest first
        self._buf = 0  # the staging buffers the next list takes
        self._unlogged_tokens = 0  # B of device work run since the last after_step (a graph's eager warm-up)
        self.stale = True  # the LRU changed outside this path: rebuild the table before a replay
        self.zero_copy_experts = self.fills = self.steps = 0  # experts read over PCIe; kept in a slot
        self.cpu_experts = 0  # missed experts the CPU computed (through the mailbox)
        self.link_blocks = 0  # expert blocks read over PCIe: one per (token, choice) pair read in place

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.device.type == "cuda" else t

    # -- inside the graph -------------------------------------------------------------------------
    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Device work only (captured): log the routing, claim free slots for the pairs read from the
        store, compute every routed expert where the table says it is. x (N, H), ids (N, k) → (N, H)."""
        N, k = ids.shape
        self._unlogged_tokens = max(self._unlogged_tokens, N)
        if self.log is None:  # the first call is a warm-up, outside any capture
            L = self.store.n_layers
            self.log = torch.full((L, self.max_tokens * k), -1, dtype=torch.int64, device=self.device)  # (L, B·k)
            self.claims = torch.full_like(self.log, -1)  # (L, B·k) offset of the slot each pair filled, or -1
            self.cpu_log = torch.zeros_like(self.log)  # (L, B·k) 1: the CPU computed the pair
            self.logs_host = [tuple(self._host(torch.empty_like(t, device="cpu"))
                                    for t in (self.log, self.claims, self.cpu_log)) for _ in range(2)]
            self._open_mailbox(k)
        offsets = self.table[layer]  # (E,)
        log = self.log[layer, :N * k]
        posting = self.mailbox is not None
        if posting:  # part of the misses to the CPU: their pairs get id -1 below
            ids = self.mailbox.post(layer, x, ids, weights, offsets, self.pool_numel, self._gpu_ids[:N * k], log,
                                    self.cpu_log[layer, :N * k])
            log = None  # written by the post
        # (N·k,) a free slot's offset per pair read from the store, written into this layer's claims row,
        # the pairs' expert ids into its log row
        spare = moe_decode_gpu.claim_free_slots(ids, offsets, self.spares, self.counter, self.pool_numel,
                                                out=self.claims[layer, :N * k], log=log,
                                                evict=(self.victims, self.table.view(-1), self.host_table))
        cpu = self.mailbox.wait_args if posting else None
        if self.store.quantised:  # offsets, spares and the pool in bytes: the blocks read in place
            return quant_moe_gpu.moe_decode_quant(x, ids, weights, self.cache.pool, self.store.layouts[layer].kernel_parts,
                                                  self.store.expert_ffn, offsets=offsets, spare=spare, admit=True,
                                                  cpu=cpu)
        return moe_decode_gpu.moe_decode(x, ids, weights, self.cache.gate_up, self.cache.down,
                                         offsets=offsets, spare=spare, admit=True, cpu=cpu)

    def _open_mailbox(self, top_k: int) -> None:
        if self.mailbox_off is not None or self.mailbox is not None:
            return
        try:
            self.mailbox = CpuMailbox(self.store, self.device, self.max_tokens, top_k, self.cpu_split.values())
        except RuntimeError as e:  # no native extension: every miss is read over PCIe
            self.mailbox_off = self.mailbox_failed = str(e)
            return
        self._gpu_ids = torch.empty(self.max_tokens * top_k, dtype=torch.int64, device=self.device)

    @property
    def runnable(self) -> bool:
        """False once a split that never uses the link (static, cpu-only) has lost its mailbox: their
        misses must not be read over PCIe, so their steps go back to pieces."""
        return self.mailbox_failed is None or self.cpu_split is None or self.cpu_split.uses_link

    def _update_split(self) -> None:
        """The worker's measured costs into the decode model, and its split into the next replays."""
        if self.mailbox is not None:
            self.cpu_split.observe(self.mailbox.fit_sums())
            values = self.cpu_split.values()  # the worker's line, or the pieces' CPU sets, may have moved them
            if values != self.mailbox.split_values:
                self.mailbox.set_split(values)

    def close(self) -> None:
        """Stop the CPU mailbox's worker (after the device has finished with it)."""
        if self.mailbox is not None:
            self.mailbox.close()

    # -- between replays --------------------------------------------------------------------------
    def before_step(self, stream=None) -> None:
        """List the slots the next replay's misses may claim and queue the lists ahead of it. Needs
        no log of the replay still running: the device keeps its own table (victims pointed back to
        the store by the claim kernel, fills pointed at their slots by the sum kernel), and the slots
        listed for a step in flight are not listed again."""
        if self._unlogged_tokens:  # layers ran eagerly without after_step (the warm-up before a capture)
            # Their claims took listed slots and wrote other experts' weights over victims: their log
            # is read as a step's, or the host's table would point those victims at their old slots.
            self.after_step(self._unlogged_tokens, replay=False)
        if self._next is not None:  # listed for layers that never ran
            self.lru.give_back(self._next.held)
            self._next = None
        claims = self.cpu_split is None or self.cpu_split.uses_link  # else no miss takes a slot: no list matters
        if claims and self._inflight and self._wanted > self.lag_list_share * self.cache.n_slots:
            self.drain()  # a tight cache: list from the LRU as the last step left it (LAG_LIST_SHARE)
        if self.stale:
            self.drain()  # every log read: the LRU is the cache as it stands
            self._rebuild(stream)
            # From pinned pages, in stream order before the replay; the host writes the mirror next
            # after a log wait behind this copy.
            self.table.copy_(self.mirror, non_blocking=True)
        self._update_split()
        self._next = self._list_slots()
        spares, victims = self.lists_host[self._next.buf]
        self.spares.copy_(spares, non_blocking=True)
        self.victims.copy_(victims, non_blocking=True)
        self.counter.zero_()

    def after_step(self, n_tokens: int, replay: bool = True) -> None:
        """Queue the logs' copy to the host behind the replay just launched (replay False: behind
        layers run eagerly, not counted as a graph step), then read the step before's logs: the host
        settles a step's cache while the next one runs."""
        self._unlogged_tokens = 0
        step, self._next = self._next, None
        assert step is not None, "before_step lists the slots of every step"
        # The mailbox opens in the first step's first layer, before any post, and stays open: without it
        # no step has a CPU log
        logs = (self.log, self.claims) + ((self.cpu_log,) if self.mailbox is not None else ())
        for host, dev in zip(self.logs_host[step.buf], logs):
            host.copy_(dev, non_blocking=True)
        if self.mailbox is not None:
            self.mailbox.queue_check()
        if self.device.type == "cuda":
            step.ready = torch.cuda.Event()
            step.ready.record()
        else:
            step.ready = _Done()
        step.n_tokens = n_tokens
        self._inflight.append(step)
        self.steps += replay
        while len(self._inflight) > 1:
            self._read(self._inflight.popleft())

    def leave(self) -> None:
        """A step of another form follows: read every step's logs now, hand the listed free slots back
        to the LRU, and rebuild the table from the LRU before the next replay."""
        if self._unlogged_tokens:
            self.after_step(self._unlogged_tokens, replay=False)
        self.drain()
        if self._next is not None:
            self.lru.give_back(self._next.held)
            self._next = None
        self.stale = True

    def listed(self) -> tuple[list[int], list[tuple[int, int]]]:
        """The slots listed for the next step: (free slots held, victims: the entries whose slots follow)."""
        if self._next is None:
            return [], []
        return list(self._next.held), list(self._next.victims.values())

    def held(self) -> list[int]:
        """Free slots out of the LRU's hands: listed for the next step or for one in flight."""
        steps = list(self._inflight) + ([self._next] if self._next is not None else [])
        return [slot for step in steps for slot in step.held]

    def drain(self) -> None:
        """Read every step's logs now (waits for the replays in flight)."""
        while self._inflight:
            self._read(self._inflight.popleft())

    def _read(self, step: "_Listed") -> None:
        step.ready.synchronize()  # that replay has finished: none of its kernels reads or writes a slot now
        if self.mailbox is not None:
            self.mailbox.check()
        n, k = step.n_tokens, self.log.shape[1] // self.max_tokens
        log_host, claims_host, cpu_host = self.logs_host[step.buf]
        # (without the mailbox the device's CPU log was never written)
        cpu = cpu_host[:, :n * k].numpy() if self.mailbox is not None else np.zeros_like(claims_host[:, :n * k].numpy())
        self._account(log_host[:, :n * k].numpy().reshape(-1, n, k), claims_host[:, :n * k].numpy(), cpu, step)

    def _account(self, log: np.ndarray, claims: np.ndarray, cpu: np.ndarray, step: "_Listed") -> None:
        """log (L, B, k), claims (L, B·k) and cpu (L, B·k; 1: the CPU computed the pair) of a finished
        replay, with the slots listed for it: LRU hits refreshed, misses counted, victims of claimed
        slots evicted, missed experts admitted into the slots they filled (as the device did), the
        listed free slots left over given back."""
        lru, E = self.lru, self.store.n_experts
        L = log.shape[0]
        ids = log.reshape(L, -1)  # (L, B·k)
        flat = (np.arange(L)[:, None] * E + ids).ravel()
        counts = np.bincount(flat[ids.ravel() >= 0], minlength=L * E).reshape(L, E)  # tokens per (layer, expert)
        active = counts > 0
        mirror = self.mirror.numpy()
        hit = active & (mirror != self.host_offsets)  # entries that pointed to a slot when the step began
        claim_layers, claim_pairs = np.nonzero(claims >= 0)  # pairs that claimed a listed slot, layer-major
        claimed = (claims[claim_layers, claim_pairs] // self.slot_numel).tolist()
        taken = [(slot, step.victims[slot]) for slot in claimed if slot in step.victims]
        for slot, claim_layer in zip(claimed, claim_layers.tolist()):
            victim = step.victims.get(slot)
            if victim is not None and claim_layer <= victim[0]:  # its layer read it from the store
                hit[victim] = False
        hit_layers, hit_experts = np.nonzero(hit)  # layer-major: the order the replay used them in
        lru.refresh(list(zip(hit_layers.tolist(), hit_experts.tolist())))
        if self.window is not None:
            hits_per_layer, active_per_layer = hit.sum(1), active.sum(1)
            for layer in np.flatnonzero(active_per_layer).tolist():
                self.window.append((int(hits_per_layer[layer]), int(active_per_layer[layer])))
        on_cpu = np.zeros_like(active)  # (L, E) experts the CPU computed (none without a mailbox)
        cpu_layers, cpu_pairs = np.nonzero(cpu)
        on_cpu[cpu_layers, ids[cpu_layers, cpu_pairs]] = True
        n_missed = int((active & ~hit).sum())
        lru.misses += n_missed
        n_cpu = int(on_cpu.sum())
        self.cpu_experts += n_cpu
        self.zero_copy_experts += n_missed - n_cpu
        for slot, key in taken:  # a miss wrote over these entries' weights
            lru.evict(key)
            mirror[key] = self.host_offsets[key]
        layers, pairs = claim_layers, claim_pairs
        experts = ids[layers, pairs]
        # Two tokens that missed the same expert each filled a slot: the first copy is kept (the sum
        # kernel's rule), the other slot is free.
        _, first = np.unique(layers * E + experts, return_index=True)
        first.sort()  # admitted in the order the replay filled them
        layers, experts, offsets = layers[first], experts[first], claims[layers[first], pairs[first]]
        kept = set()
        for layer, e, offset in zip(layers.tolist(), experts.tolist(), offsets.tolist()):
            slot = offset // self.slot_numel
            lru.admit_into(layer, e, slot)
            mirror[layer, e] = offset
            kept.add(slot)
        self.lru.give_back([s for s in step.held if s not in kept] + [s for s, _ in taken if s not in kept])
        self.fills += len(kept)
        outside = int(counts[active & ~hit & ~on_cpu].sum())  # pairs read from the store
        self.link_blocks += outside  # (a pair's fill writes what it read: nothing more crosses the link)
        self._wanted = min(self.max_spares, math.ceil(1.25 * outside) + 4)

    def _list_slots(self) -> "_Listed":
        """About the last step's misses of slots: free ones (held out of the LRU), then those of the
        least recently used entries, which stay cached until a miss claims their slot. Victims listed
        for a step in flight are left out: their slots may be taken already."""
        held = self.lru.take_free(self._wanted)
        busy = {key for step in self._inflight for key in step.victims.values()}
        keys = self.lru.oldest(self._wanted - len(held), exclude=busy)
        entries = self.lru.entries
        victim_slots = [entries[key].slot for key in keys]
        step = _Listed(held, dict(zip(victim_slots, keys)), self._buf)
        self._buf ^= 1
        listed, victims = (t.numpy() for t in self.lists_host[step.buf])
        n = len(held) + len(victim_slots)
        listed.fill(-1)
        listed[:n] = np.asarray(held + victim_slots, dtype=np.int64) * self.slot_numel
        victims.fill(-1)
        E = self.store.n_experts
        victims[len(held):n] = [layer * E + e for layer, e in keys]
        return step

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
                "free_slots_listed": len(self._next.held) if self._next is not None else 0,
                "cpu_experts": self.cpu_experts,
                "cpu_split": self.cpu_split.telemetry() if self.cpu_split is not None else None,
                "cpu_mailbox": self.mailbox.telemetry() if self.mailbox is not None else
                {"off": self.mailbox_off or "opens at the first step"}}


@dataclass
class _Listed:
    """The slots listed for one step, and where its logs go."""

    held: list[int]  # free slots, held out of the LRU until the step's log is read
    victims: dict[int, tuple[int, int]]  # slot → the cached entry it holds
    buf: int  # which of the two staging buffers its lists and logs take
    n_tokens: int = 0
    ready: object = None  # a CUDA event after its logs' copy (_Done on the simulated GPU)


class _Done:
    """The simulated GPU's stand-in for a finished CUDA event."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True
