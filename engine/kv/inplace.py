"""InplaceKVCache: the four-region KV format of seed 000 (§4) with its operations
init / append / views / flush.

Regions (E = PartitionSpec.pingpong_tokens, D = d_window):

    D-window    device  (n_layers, max_batch, D, 2, n_kv, hs)   each sequence's newest tokens, ≤ D
    ping-pong   device  (2, G·E, 2, n_kv, hs)                   two buffers, created once, overwritten;
                                                                each takes up to G extent-layers of one row
    pinned      host    page-locked extents (n_layers, E, 2, n_kv, hs)   the GPU's placed share
    unpinned    host    pageable, per layer (2, n_kv, tokens, hs)        the CPU's placed share

Tokens bound for the unpinned region leave the device through a page-locked staging ring of R layer
slots (one D2H per placement); the CPU side's thread then lays each layer out per head.

Each token has one final residency, chosen when it is written: prefill KV goes straight to the
pinned or unpinned region; decode KV is staged in the D-window and, once D entries accumulate,
evicted whole to one side. Placed tokens never move; crop frees tail extents; free releases all.
The format does not choose the split: each step is planned with a CPU share r from outside and
eviction batches are routed so that a sequence's running share follows it (sched/roofline.py).

A step is `plan_step` (reads captured from the state before the step, writes reserved), then per
layer `append`, the `*_views` and `flush` (that layer's placements, copies on the write-back
direction overlapping the next layers), then `finish` and `commit`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from engine.errors import ContextOverflowError, OutOfMemoryError
from engine.kernels.attention_gpu import padding_mask
from engine.kv.partition import PINGPONG_EXTENTS, PartitionSpec
from engine.kv.regions import PinnedRegion, RegionRun, UnpinnedRegion
from engine.kv.staging import StagingRing
from engine.sched.roofline import route_to_cpu, split_run


@dataclass
class SeqState:
    slot: int  # row of the D-window
    unpinned: RegionRun
    pinned: RegionRun
    length: int = 0  # tokens cached
    window: int = 0  # tokens staged in the D-window: positions [length − window, length)

    @property
    def placed(self) -> int:
        return self.length - self.window


@dataclass
class Placement:
    """n tokens of one sequence to one host region: from the D-window or from this step's new KV."""

    row: int
    source: str  # "window" | "new"
    src_start: int
    n: int
    to_cpu: bool
    extent: int
    ext_start: int


@dataclass
class StepPlan:
    seqs: list[SeqState]
    n_new: int
    decode: bool
    positions: torch.Tensor  # (B, T) on the device
    # reads, captured before the step's writes
    window_len: list[int]  # keys per row in the D-window this step (decode: including the new token)
    window_max: int
    window_excluded: torch.Tensor | None  # (B, 1, 1, window_max) padding mask, None if no padding
    slot_start: int | None  # rows occupy D-window rows slot_start.. contiguously, else gather by slots
    slots: torch.Tensor  # (B,) int64 on the device
    append_pos: torch.Tensor | None  # (B,) decode: where the new token goes in the D-window
    chunks: list[tuple[int, list[tuple[int, int]], int]]  # per ping-pong load: (row, [(extent, tokens)…], tokens)
    chunk_rows: torch.Tensor | None  # (P,) int64 on the device: each chunk's row
    cpu_ranges: list[list[tuple[int, int]]]  # per row: unpinned arena token ranges
    cpu_tokens: int
    stream_tokens: int
    # writes
    placements: list[Placement]
    tails: list[tuple[int, int, int, int]]  # (row, new-token start, n, D-window start): prefill into the window
    window_after: list[int]
    stage: torch.Tensor | None = None  # (R, S, 2, n_kv, hs) host staging ring for the CPU region's tokens
    stage_at: list[int] = field(default_factory=list)  # per placement: its offset in `stage` (CPU-bound ones)
    unpinned_jobs: list | None = None  # built by InplaceKVCache._unpinned_jobs
    placed_layers: set = field(default_factory=set)


class InplaceKVCache:
    def __init__(self, spec: PartitionSpec, *, n_layers: int, n_kv_heads: int, head_dim: int,
                 max_context: int, max_batch: int, device: torch.device, dtype: torch.dtype,
                 transport, host_executor):
        """init: size the regions and pre-allocate the D-window, ping-pong and (virtual) unpinned ones."""
        spec.validate()
        self.spec, self.transport, self.executor = spec, transport, host_executor
        self.n_layers, self.n_kv, self.head_dim = n_layers, n_kv_heads, head_dim
        self.max_context, self.max_batch, self.device, self.dtype = max_context, max_batch, device, dtype
        D, E = spec.d_window, spec.pingpong_tokens
        self.token_bytes = 2 * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()  # per layer
        need = spec.device_bytes(n_layers, max_batch, n_kv_heads, head_dim, dtype)
        if spec.vram_budget_bytes is not None and need > spec.vram_budget_bytes:
            raise OutOfMemoryError(f"the D-window and ping-pong buffers need {need / 2**30:.2f} GiB; the VRAM budget "
                                   f"leaves {max(spec.vram_budget_bytes, 0) / 2**30:.2f} GiB after the weights",
                                   "lower d_window or max_batch, or raise vram_budget_gb")
        try:  # zeros: padded keys are masked, but their values must stay finite
            self.window = torch.zeros((n_layers, max_batch, D, 2, n_kv_heads, head_dim), device=device, dtype=dtype)
            self.pingpong = torch.empty((2, PINGPONG_EXTENTS * E, 2, n_kv_heads, head_dim), device=device, dtype=dtype)
        except torch.OutOfMemoryError as e:
            raise OutOfMemoryError(f"the D-window and ping-pong buffers do not fit on {device}",
                                   "lower d_window or max_batch") from e
        n_extents = max_batch * -(-max_context // E) + max_batch  # r = 1 or r = 0 for every sequence
        self.unpinned = UnpinnedRegion(n_layers, n_kv_heads, head_dim, E, n_extents, dtype)
        self.pinned = PinnedRegion(transport, n_layers, n_kv_heads, head_dim, E, n_extents, dtype,
                                   spec.pinned_cap_bytes)
        self.seqs: dict[int, SeqState] = {}
        self._free_slots = list(range(max_batch))
        self._next_id = 0
        self.staging = StagingRing(transport, n_layers, n_kv_heads, head_dim, dtype)  # the CPU region's way in
        self.pinned.reserve_ahead()  # the first pinned extent is prepared at load, not at the first prefill
        self.d2h_done = transport.event()
        self.flush_pending = False  # the D-window was read by write-backs still in flight
        self.d2h_bytes = 0

    # -- sequences ----------------------------------------------------------------------------
    def new_sequence(self) -> int:
        if not self._free_slots:
            raise OutOfMemoryError(f"all {self.max_batch} KV sequence slots are in use",
                                   "end a chat or raise max_batch")
        sid, self._next_id = self._next_id, self._next_id + 1
        E = self.spec.pingpong_tokens
        self.seqs[sid] = SeqState(heapq.heappop(self._free_slots), RegionRun(E), RegionRun(E))
        return sid

    def free(self, seq_id: int) -> None:
        s = self.seqs.pop(seq_id)
        self.unpinned.release(s.unpinned.release_all())
        self.pinned.release(s.pinned.release_all())
        heapq.heappush(self._free_slots, s.slot)

    def crop(self, seq_id: int, n_tokens: int) -> None:
        s = self.seqs[seq_id]
        if n_tokens >= s.length:
            return
        if n_tokens >= s.placed:
            s.window = n_tokens - s.placed
        else:
            s.window = 0
            self.unpinned.release(s.unpinned.crop(n_tokens))
            self.pinned.release(s.pinned.crop(n_tokens))
        s.length = n_tokens

    # -- planning: reads from the current state, writes routed by the CPU share r ----------------
    def plan_step(self, seq_ids: list[int], n_new: int, r_target: float) -> StepPlan:
        seqs = [self.seqs[s] for s in seq_ids]
        for s in seqs:
            if s.length + n_new > self.max_context:
                raise ContextOverflowError(f"{s.length + n_new} tokens exceed the context window of {self.max_context}",
                                           "start a new chat, shorten the prompt, or raise max_context")
        dev, D, decode = self.device, self.spec.d_window, n_new == 1
        slots = [s.slot for s in seqs]
        window_len = [s.window + 1 if decode else s.window for s in seqs]
        wmax = max(window_len)
        excluded = None
        if wmax and min(window_len) != wmax:
            excluded = padding_mask(torch.tensor(window_len, device=dev), wmax)
        chunks = []  # consecutive extent-layers of one row share a ping-pong buffer, up to G of them:
        for row, s in enumerate(seqs):  # one attention call per G DMAs (host calls cost tens of µs)
            fills = list(s.pinned.extent_fills())
            for i in range(0, len(fills), PINGPONG_EXTENTS):
                group = fills[i:i + PINGPONG_EXTENTS]
                chunks.append((row, group, sum(n for _, n in group)))
        plan = StepPlan(
            seqs=seqs, n_new=n_new, decode=decode,
            positions=(torch.tensor([s.length for s in seqs])[:, None] + torch.arange(n_new)).to(dev),
            window_len=window_len, window_max=wmax, window_excluded=excluded,
            slot_start=slots[0] if slots == list(range(slots[0], slots[0] + len(slots))) else None,
            slots=torch.tensor(slots, device=dev),
            append_pos=torch.tensor([s.window for s in seqs], device=dev) if decode else None,
            chunks=chunks, chunk_rows=torch.tensor([c[0] for c in chunks], device=dev) if chunks else None,
            cpu_ranges=[s.unpinned.arena_ranges() for s in seqs],
            cpu_tokens=sum(s.unpinned.fill for s in seqs), stream_tokens=sum(c[2] for c in chunks),
            placements=[], tails=[], window_after=[])
        for row, s in enumerate(seqs):
            if decode:
                if s.window + 1 < D:
                    plan.window_after.append(s.window + 1)
                    continue
                first = s.length + 1 - D  # the full D-window is evicted whole to one side
                to_cpu = route_to_cpu(s.unpinned.fill, s.placed, D, r_target)
                self._route(plan, row, s, [("window", 0, D)], first, D if to_cpu else 0)
                plan.window_after.append(0)
            else:
                staged = s.window + n_new
                if staged < D:  # short prefill (a chat turn): staged with the decode tokens; a decode
                    # step always finds room for its token, since a window that would be full is placed
                    plan.tails.append((row, 0, n_new, s.window))
                    plan.window_after.append(staged)
                    continue
                rem = staged % self.spec.block_size  # a partial last block waits in the D-window
                n_place = staged - rem
                n_cpu = split_run(s.unpinned.fill, s.placed, n_place, self.spec.block_size, r_target)
                sources = [("window", 0, s.window), ("new", 0, n_new - rem)]
                self._route(plan, row, s, [x for x in sources if x[2]], s.placed, n_cpu)
                if rem:
                    plan.tails.append((row, n_new - rem, rem, 0))
                plan.window_after.append(rem)
        at = 0
        for p in plan.placements:
            plan.stage_at.append(at if p.to_cpu else -1)
            at += p.n if p.to_cpu else 0
        if at:
            floor = max(sum(p.n for p in plan.placements), self.max_batch * D, D + 512)
            plan.stage = self.staging.slots(at, floor)
        self.pinned.reserve_ahead()  # the next pinned extent is prepared one window ahead
        return plan

    def _route(self, plan: StepPlan, row: int, s: SeqState, sources: list, first_pos: int, n_cpu: int) -> None:
        """Reserve room for a contiguous position run (first n_cpu tokens to the CPU region, the rest
        pinned) and record the copies. A full region sends its share to the other one."""
        n = sum(x[2] for x in sources)
        dests = []
        for to_cpu, count, pos in ((True, n_cpu, first_pos), (False, n - n_cpu, first_pos + n_cpu)):
            if not count:
                continue
            run, region = (s.unpinned, self.unpinned) if to_cpu else (s.pinned, self.pinned)
            pieces = run.reserve(count, pos, region)
            if pieces is None:
                run, region, to_cpu = (s.pinned, self.pinned, False) if to_cpu else (s.unpinned, self.unpinned, True)
                pieces = run.reserve(count, pos, region)
            if pieces is None:
                raise OutOfMemoryError("the host KV regions are full",
                                       "end or shorten a chat, lower max_batch or max_context")
            dests += [(to_cpu, ext, off, k) for ext, off, k in pieces]
        # Walk sources and destinations together: one Placement per overlap.
        si, di, s_used, d_used = 0, 0, 0, 0
        while si < len(sources) and di < len(dests):
            src, src_start, src_n = sources[si]
            to_cpu, ext, off, d_n = dests[di]
            k = min(src_n - s_used, d_n - d_used)
            plan.placements.append(Placement(row, src, src_start + s_used, k, to_cpu, ext, off + d_used))
            s_used, d_used = s_used + k, d_used + k
            if s_used == src_n:
                si, s_used = si + 1, 0
            if d_used == d_n:
                di, d_used = di + 1, 0

    # -- append and views ---------------------------------------------------------------------
    def append(self, layer: int, plan: StepPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, n_kv, T, hs). Decode: into the D-window, before attention reads it; prefill KV is
        written by `flush(layer, …)` straight to its final region."""
        if plan.decode:
            self.window[layer][plan.slots, plan.append_pos] = torch.stack((k[:, :, 0], v[:, :, 0]), dim=1)

    def window_views(self, layer: int, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) each (B, n_kv, window_max, hs): zero-copy when the rows' slots are adjacent."""
        w = self.window[layer]
        if plan.slot_start is not None:
            w = w[plan.slot_start:plan.slot_start + len(plan.seqs), :plan.window_max]
        else:
            w = w[plan.slots, :plan.window_max]
        return w[:, :, 0].transpose(1, 2), w[:, :, 1].transpose(1, 2)

    def pinned_slab(self, layer: int, ext: int, n: int) -> torch.Tensor:
        """(n, 2, n_kv, hs): one extent-layer of the load region, one contiguous DMA source."""
        return self.pinned.slab(layer, ext, 0, n)

    def cpu_views(self, layer: int, plan: StepPlan) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per row, zero-copy (k, v) views (n_kv, t, hs) of its unpinned tokens."""
        return [self.unpinned.views(layer, ranges) for ranges in plan.cpu_ranges]

    # -- flush: write-time routing, layer by layer, on the write-back direction ------------------
    def flush(self, layer: int, plan: StepPlan, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> None:
        """This layer's placements: evicted D-window batches and (prefill) the new tokens, copied to
        their final regions on the d2h stream while later layers compute. Call after the layer's
        attention has been enqueued (the D-window tail writes must follow its reads)."""
        plan.placed_layers.add(layer)
        if not plan.placements and not plan.tails:
            return
        tr = self.transport
        compute = tr.compute_stream()
        new = None  # (B, T, 2, n_kv, hs): the layer's new KV, token-interleaved like every region
        if k is not None and not plan.decode:
            new = torch.stack((k, v), dim=1).permute(0, 3, 1, 2, 4).contiguous()
        ready = tr.event()
        ready.record(compute)
        slot = self.staging.slot(layer) if plan.stage is not None else None
        if slot is not None:
            self.staging.wait_slot(slot)  # the CPU side's thread has laid out what the ring slot held
        with tr.on(tr.d2h):
            tr.wait(tr.d2h, ready)  # after this layer's D-window append and new KV
            for p, at in zip(plan.placements, plan.stage_at):
                if p.source == "window":
                    src = self.window[layer, plan.seqs[p.row].slot, p.src_start:p.src_start + p.n]
                elif new is not None:
                    src = new[p.row, p.src_start:p.src_start + p.n]
                else:
                    continue  # a failed step's new tokens: cropped away right after
                dst = plan.stage[slot, at:at + p.n] if p.to_cpu else self.pinned.slab(layer, p.extent, p.ext_start, p.n)
                dst.copy_(src, non_blocking=True)  # one contiguous DMA
            layer_done = tr.event()
            layer_done.record(tr.d2h)
        jobs = self._unpinned_jobs(plan)
        if jobs:  # the CPU side's thread lays this layer out per head as soon as it has landed, while
            # later layers compute (one job per layer: only the last layer's is left at the step's end)
            self.staging.jobs[slot] = self.executor.submit(self._write_unpinned, layer_done, plan.stage[slot], layer, jobs)
        if new is not None:
            tr.keep_alive(new, tr.d2h)
            if plan.tails:
                tr.wait(compute, layer_done)  # the write-backs have read the old D-window contents
                for row, src_start, n, dst in plan.tails:
                    self.window[layer, plan.seqs[row].slot, dst:dst + n] = new[row, src_start:src_start + n]

    def finish(self, plan: StepPlan) -> None:
        """End of step: layers a failed step never reached still get their D-window write-backs (the
        tokens already placed elsewhere in other layers must exist in every layer). Each flushed
        layer's CPU-bound tokens were handed to the CPU side's thread, which lays them out per head
        as soon as that layer's copies have landed."""
        for layer in range(self.n_layers):
            if layer not in plan.placed_layers:
                self.flush(layer, plan)
        if not plan.placements:
            return
        tr = self.transport
        self.d2h_done.record(tr.d2h)
        self.flush_pending = any(p.source == "window" for p in plan.placements)
        self.d2h_bytes += sum(p.n for p in plan.placements) * self.token_bytes * self.n_layers

    def _unpinned_jobs(self, plan: StepPlan) -> list[tuple[int, int, int]]:
        """(offset in the staging buffer, arena token, tokens) of each CPU-bound placement, the same
        for every layer of the step."""
        if plan.unpinned_jobs is None:
            plan.unpinned_jobs = [(at, p.extent * self.spec.pingpong_tokens + p.ext_start, p.n)
                                  for p, at in zip(plan.placements, plan.stage_at) if p.to_cpu]
        return plan.unpinned_jobs

    @torch.inference_mode()
    def _write_unpinned(self, ready, stage: torch.Tensor, layer: int, jobs: list[tuple[int, int, int]]) -> None:
        """stage: (S, 2, n_kv, hs), the ring slot holding this layer's CPU-bound tokens."""
        ready.synchronize()  # this layer's copies into the ring slot have landed
        for at, start, n in jobs:
            self.unpinned.write(layer, start, stage[at:at + n])

    def commit(self, plan: StepPlan) -> None:
        for s, w in zip(plan.seqs, plan.window_after):
            s.length += plan.n_new
            s.window = w

    def before_appends(self) -> None:
        """The next D-window writes wait for write-backs still reading it (device-side wait)."""
        if self.flush_pending:
            self.transport.wait(self.transport.compute_stream(), self.d2h_done)
            self.flush_pending = False

    # -- accounting ---------------------------------------------------------------------------
    def tokens(self) -> dict:
        seqs = self.seqs.values()
        return {"dwindow": sum(s.window for s in seqs), "pinned": sum(s.pinned.fill for s in seqs),
                "unpinned": sum(s.unpinned.fill for s in seqs)}

    def nbytes(self) -> dict:
        return {"kv_dwindow": self.window.numel() * self.window.element_size(),
                "kv_pingpong": self.pingpong.numel() * self.pingpong.element_size(),
                "kv_pinned": self.pinned.bytes_pinned, "kv_unpinned": self.unpinned.bytes_in_use,
                "kv_staging": self.staging.pinned_bytes}

    def close(self) -> None:
        self.staging.close()
        self.pinned.close()
