"""OffloadedExperts: routed experts in a host store, a GPU LRU cache of them, a per-layer split.

One MoE layer (`run`), in order:
1. The layer's routing, and the lookahead prediction for the next layer, come to the host in one
   copy (the layer's only host sync).
2. Active experts are looked up in the LRU: hits run on the GPU; the planner splits the misses into
   fills (copied into slots on the copy stream, then computed on the GPU, kept) and a CPU set.
3. The CPU set is prepared (engine/experts/cpu_set.py) and starts in a worker thread, computing in
   place from the store.
4. The GPU side — hits and fills — runs as one grouped computation over the slot pool
   (engine/experts/gpu_set.py).
5. Predicted next-layer misses are prefetched into free or stale slots while the link is idle.
6. The CPU part joins and is added. The sum does not depend on which side computed what.

With the compute device a CPU (`simulate_hybrid`), "slots" are host tensors and copies are
synchronous, but the LRU, fills, CPU set, prefetch and merge all run as on a GPU.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np
import torch

from engine.experts.cache import ExpertCache
from engine.experts.cpu_mailbox import MissSplit, graph_cpu_enabled
from engine.experts.cpu_set import CpuSetRunner, cpu_set_kernel, per_expert_moe, prepare_cpu_set
from engine.experts.executor import ExpertExecutor
from engine.experts.gpu_set import GpuSet
from engine.experts.graph_forms import GraphForms
from engine.experts.measured_costs import MeasuredCosts
from engine.experts.planner import PLANNED_POLICIES, MissPlanner
from engine.experts.predictor import GateLookahead, HotTable
from engine.experts.store import ExpertStore
from engine.experts.zero_copy import ZeroCopyDecode
from engine.kernels import moe_decode_gpu, quant_linear_gpu
from engine.kernels.cuda_streams import indexed
from engine.kernels.experts_gpu import grouped_impl
from engine.kernels.experts_torch import ClampedSwiGLU
from engine.sched.expert_cost import ExpertCostModel

OFFLOAD_POLICIES = PLANNED_POLICIES  # each offload policy is a way the planner splits a layer's misses
# Each policy's decode steps run as the one graph where a device table opens (zero_copy.py); they
# differ in the costs its split weighs: adaptive the model's, on-demand no CPU (misses read in place and
# filled), static and cpu-only no link (every miss to the CPU, so the slots never change; cpu-only's
# table has none). The one graph decoded 2.0x adaptive's pieces, 1.02-1.12x on-demand's and 1.13-1.30x
# static's and cpu-only's (BF16, 8 GB, H100: benchmarks/h200/2026-12-07-miss-split-h100/ and
# 2026-12-07-every-policy-graph-h100/).
# The driving thread's host work in `run` after the layer's sync, in order (seconds in `host_split`):
# LRU lookup; the plan; the CPU set's preparation and hand-off; the fills; the GPU set's launches;
# prefetches; bookkeeping nothing above waits for (prediction scores, the trace); then (layers with a
# CPU set) the result's return and merge.
HOST_PARTS = ("lookup", "plan", "cpu_set", "fill", "gpu_set", "prefetch", "bookkeeping", "merge")
log = logging.getLogger("tandem")


class OffloadedExperts(GraphForms, ExpertExecutor):  # GraphForms: its captured decode steps
    def __init__(self, policy: str, store: ExpertStore, *, device: torch.device, n_slots: int | None = None,
                 costs: ExpertCostModel | None = None, max_decode_tokens: int = 4, cpu_ffn=None,
                 cpu_kernel: str | None = None, window: int = 256):
        if policy not in OFFLOAD_POLICIES:
            raise ValueError(f"unknown offload policy '{policy}' (one of {', '.join(OFFLOAD_POLICIES)})")
        self.policy, self.store, self.device = policy, store, indexed(device)
        # bytes an expert costs the link and the CPU: the store's (quantised: the file's blocks)
        self.costs = costs or ExpertCostModel.from_shape(store.hidden, store.expert_ffn,
                                                         store.block_bytes / store.weights_per_expert)
        self.planner = MissPlanner(policy, self.costs, max_decode_tokens)
        # an injected per-expert kernel (tests, benchmarks), else cpu_set.prepare_cpu_set's choice
        self.cpu_prepare = per_expert_moe(cpu_ffn) if cpu_ffn is not None else None
        self.cpu_ffn, self.cpu_kernel = cpu_ffn, cpu_kernel or cpu_set_kernel(store, cpu_ffn)
        self.cache: ExpertCache | None = None
        self.predictor: GateLookahead | None = None
        self.trace = HotTable(store.n_layers, store.n_experts)  # tokens per (layer, expert), always counted
        self.hot_source: str | None = None  # what warmed the cache: a hot-table path or "even-spread"
        self._first_layer = store.layers[0]
        self._sweep_start = self._prev_sweep_start = 0  # LRU clock at the start of this / the last forward
        self._cpu_runner = CpuSetRunner()
        self._window: deque[tuple[int, int]] = deque(maxlen=window)  # (hits, lookups) per layer step
        self.cpu_executed = self.uncached_misses = self.h2d_bytes = 0
        self.cpu_s = 0.0  # worker time computing CPU sets
        self.cpu_queue_s = 0.0  # from each CPU set's submit to the worker starting it
        self.cpu_wait_s = 0.0  # time the GPU-driving thread waited for them
        self.device_wait_s = 0.0  # time it waited, at each layer's sync, for the device (pieces, fills)
        self.run_s = 0.0  # its whole time in `run` (the rest is host work: planning, launches, copies)
        self.host_split = dict.fromkeys(HOST_PARTS, 0.0)
        self._cpu_out: dict[int, torch.Tensor] = {}  # N → (N, H) fp32 pinned result buffer of the CPU set
        self._rate_mark = (time.perf_counter(), 0)
        self.measured = MeasuredCosts(self.costs)  # the model as this machine's CPU sets and layer steps correct it
        self._next_layer = dict(zip(store.layers, store.layers[1:]))
        # the last layer step, until the next layer's sync ends it: (layer, phase, split, modelled ms, sync time)
        self._open_step: tuple[int, str, bool, float, float] | None = None
        self.forms: dict[int, ClampedSwiGLU] = {}  # layers whose experts are not plain SwiGLU (gpt-oss)
        self._cpu_forms: dict[int, ClampedSwiGLU] = {}  # the same with host copies of the biases
        self.zero_copy: ZeroCopyDecode | None = None  # the whole-step graph's device table (CUDA)
        self.zero_copy_off: str | None = None  # why there is none
        self._opened = False
        if n_slots is not None:
            self.open_cache(n_slots)

    # -- set-up ---------------------------------------------------------------------------------
    def open_cache(self, n_slots: int) -> None:
        """Allocate the slot pool (once) and the per-layer slot map; `cpu-only` keeps no slots."""
        if self._opened:
            raise RuntimeError("the expert cache is allocated already")
        n_slots = 0 if self.policy == "cpu-only" else max(0, min(int(n_slots), self.store.n_routed))
        s = self.store
        if n_slots:
            self.cache = ExpertCache(n_slots, s.hidden, s.expert_ffn, s.dtype, self.device,
                                     block_bytes=s.block_bytes if s.quantised else 0)
        self.gpu_set = GpuSet(self.cache, n_slots, s.n_experts, self.device, s.dtype, s.layouts)
        self._opened = True
        self._open_zero_copy()

    def _open_zero_copy(self) -> None:
        """On a GPU decode runs as one graph (zero_copy.py), its split of each layer's misses the
        policy's (MissSplit; on-demand: none, every miss read in place)."""
        if self.forms:  # its device table runs the matrix-vector kernels: plain SwiGLU only
            self.zero_copy_off = "its experts have biases and a clamped SwiGLU"
        elif self.cache is None and self.policy != "cpu-only":
            self.zero_copy_off = "no cache slots"
        elif self.policy in ("static", "cpu-only") and not graph_cpu_enabled():
            self.zero_copy_off = "TANDEM_GRAPH_CPU=0, and its misses go only to the CPU"
        elif self.device.type != "cuda" or moe_decode_gpu.triton is None:
            self.zero_copy_off = "needs CUDA and Triton"
        elif not self.store.pinned:
            self.zero_copy_off = "the host store is not pinned"
        elif self.store.quantised and not quant_linear_gpu.works(self.device):
            self.zero_copy_off = "the GPU kernels over quantised blocks do not run here"
        else:
            s = self.store
            split = None if self.policy == "on-demand" or not graph_cpu_enabled() else \
                MissSplit(self.measured, link=self.policy == "adaptive")
            # cpu-only's table points every expert at the store. Its pool is one slot that no miss takes
            # (its split never uses the link): the kernels get a real base pointer, which an empty CUDA
            # tensor (address 0) may not pass Triton's check of
            cache = self.cache or ExpertCache(1, s.hidden, s.expert_ffn, s.dtype, self.device,
                                              block_bytes=s.block_bytes if s.quantised else 0)
            try:
                self.zero_copy = ZeroCopyDecode(s, cache, self.device,
                                                min(self.planner.max_decode_tokens, moe_decode_gpu.MAX_TOKENS),
                                                window=self._window, cpu_split=split)
            except RuntimeError as e:  # the driver cannot map the store
                self.zero_copy_off = str(e)
                log.warning("decode steps with offloaded experts stay in pieces: %s", e)

    def set_form(self, layer: int, form: ClampedSwiGLU) -> None:
        """The layer's experts compute `form` (gpt-oss: biases, clamped SwiGLU). The slots run it in
        the grouped GEMM with the biases on the device, the CPU set in the native expert kernel (its
        ExpertForm) with host copies of them. Over quantised slots the matrix-vector decode kernels take
        the form too (graph pieces); over BF16 slots they know only plain SwiGLU, so such a model's MoE
        layers run eagerly between graph pieces. The whole-step graph takes neither."""
        self.forms[layer] = form
        bias_dtype = torch.float32 if self.store.quantised else self.store.dtype  # what the CPU products run in
        host = lambda b: b.detach().to("cpu", bias_dtype)  # noqa: E731  (E, 2I), (E, H): small
        self._cpu_forms[layer] = ClampedSwiGLU(host(form.gate_up_bias), host(form.down_bias), form.alpha, form.limit)
        if self.zero_copy is not None:
            self.zero_copy.close()
            self.zero_copy = None
        self.zero_copy_off = "its experts have biases and a clamped SwiGLU"

    def _copy_in(self, layer: int, slots: list[int], experts: list[int]) -> None:
        """The layer's experts' blocks into these slots."""
        if not slots:
            return
        self.cache.copy_in_many(slots, [self.store.block(layer, e) for e in experts])
        self.h2d_bytes += len(slots) * self.store.block_bytes

    def attach_predictor(self, predictor: GateLookahead) -> None:
        self.predictor = predictor

    def warm(self, keys: list[tuple[int, int]], source: str) -> int:
        """Place (layer, expert) pairs into free slots at load (hot table / static placement)."""
        placed = 0
        if self.cache is not None:
            by_layer: dict[int, tuple[list[int], list[int]]] = {}  # layer → (slots, experts): one copy call each
            for layer, e in keys:
                slot = self.cache.lru.place(layer, e)
                if slot is not None:
                    slots, experts = by_layer.setdefault(layer, ([], []))
                    slots.append(slot)
                    experts.append(e)
            for layer, (slots, experts) in by_layer.items():
                self._copy_in(layer, slots, experts)
                placed += len(slots)
            self.cache.synchronize()
        self.hot_source = source
        return placed

    # -- one layer ------------------------------------------------------------------------------
    def lookahead(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The layer's routing and, with a predictor, the next layer's predicted routing below it:
        (N or 2N, k) on the device, pure device work (a decode graph piece captures it)."""
        predicted = self.predictor.propose(layer, x) if self.predictor is not None else None
        return ids if predicted is None else torch.cat([ids, predicted.to(ids.dtype)])

    def run(self, layer, x, ids, weights, routed: torch.Tensor | None = None, out: torch.Tensor | None = None,
            cpu_buf: torch.Tensor | None = None, between=None):
        """routed: `lookahead(layer, x, ids)` when the caller computed it already (graph pieces); out:
        a buffer (N, H) to write the result into (a piece's fixed input) instead of a new tensor.
        cpu_buf (N, H) fp32: the host half only — the layer's slot map goes to the device and the CPU
        set's sum (or zeros) into cpu_buf; `gpu_side` computes the rest on the device. Returns None
        then. between: called once the map is published and before the CPU set is waited for (the
        caller launches the captured `gpu_side` there, so the device computes the cached experts while
        the CPU computes its set)."""
        N, k = ids.shape
        if N == 0:
            return torch.zeros_like(x) if out is None else out.zero_()
        t_start = time.perf_counter()
        if self.zero_copy is not None:
            # This path admits and evicts behind the device table: a graph step's log still pending is
            # read first, against the LRU it was recorded with (its hits may be evicted here).
            self.zero_copy.leave()
        lru = self.cache.lru if self.cache is not None else None
        if layer == self._first_layer:  # a new forward pass begins
            self._prev_sweep_start, self._sweep_start = self._sweep_start, (lru.clock if lru else 0)
        both = self.lookahead(layer, x, ids) if routed is None else routed  # (N or 2N, k)
        predicted = both.shape[0] > N
        # The layer's one host sync: routing, prediction, and the inputs a CPU set would need, each
        # copied without blocking (into pinned pages on a GPU), then one wait for all of them.
        host_t, x_h, w_h = (t.to("cpu", non_blocking=True) for t in (both, x, weights))
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None:
            t0 = time.perf_counter()
            stream.synchronize()
            self.device_wait_s += time.perf_counter() - t0
        marks = [time.perf_counter()]  # host work after the sync, per part (see `host_split`)
        self._close_step(layer, marks[0])
        host = host_t.numpy()
        ids_h = host[:N]
        counts = np.bincount(ids_h.ravel(), minlength=self.store.n_experts)  # tokens per expert
        active = np.flatnonzero(counts).tolist()
        if lru is not None:
            hits, hit_slots, misses = lru.lookup(layer, active)
        else:
            hits, hit_slots, misses = [], [], active
            self.uncached_misses += len(active)
        self._window.append((len(hits), len(active)))
        capacity = self.cache.n_slots - len(hits) if self.cache is not None else 0
        marks.append(time.perf_counter())
        phase = self.planner.phase(N)
        self.planner.costs = self.measured.model(phase)
        split_ratios = (self.measured.step_ratio(phase, True), self.measured.step_ratio(phase, False))
        plan = self.planner.plan(N, misses, counts[misses].tolist(), len(hits), int(counts[hits].sum()),
                                 capacity, self.predictor.hit_rate() if self.predictor else None, split_ratios)
        self._open_step = (layer, phase, bool(plan.cpu),
                           max(plan.t_gpu_ms, plan.t_cpu_ms) + self.planner.costs.attn_ms, marks[0])
        marks.append(time.perf_counter())
        # The CPU set is the longest part of a bs=4 layer step: it is prepared here and
        # handed over before the fills are issued and before any bookkeeping, so it starts as early as
        # the plan allows; its worker only computes.
        on_cpu = bool(plan.cpu)
        if on_cpu:
            self._cpu_runner.submit(prepare_cpu_set(
                self.store, layer, plan.cpu, ids_h, w_h, x_h, self._result_buffer(x_h.shape),
                self._cpu_forms.get(layer), self.cpu_prepare))
            self.cpu_executed += len(plan.cpu)
        marks.append(time.perf_counter())
        fill_slots = self._fill(layer, plan.fill)
        marks.append(time.perf_counter())
        gpu_experts = hits + plan.fill
        if cpu_buf is not None:  # the next graph piece reads the map
            self.gpu_set.publish(gpu_experts, hit_slots + fill_slots, stream)
            if between is not None:
                between()
            result = None
        else:
            result = self.gpu_set.compute(layer, x, ids, weights, gpu_experts, hit_slots + fill_slots, counts[gpu_experts],
                                          self.forms.get(layer), stream,
                                          out=None if on_cpu else out) if gpu_experts else None
        marks.append(time.perf_counter())
        if plan.prefetch and predicted and self.cache is not None:
            self._prefetch(layer, host[N:], plan.prefetch)
        if lru is not None:
            lru.unlock()
        marks.append(time.perf_counter())
        self.trace.add(layer, counts)
        if self.predictor is not None:
            self.predictor.score(layer, ids_h)
            self.predictor.remember(layer, host[N:] if predicted else None)
        marks.append(time.perf_counter())
        merged_from = marks[-1]
        if on_cpu:
            cpu_out, queue_s, seconds = self._cpu_runner.result()
            self.cpu_queue_s += queue_s  # submit → start: the worker's wake-up
            self.cpu_s += seconds
            merged_from = time.perf_counter()
            self.cpu_wait_s += merged_from - marks[-1]  # the wait is not host work
            self.measured.observe_cpu(phase, plan.t_cpu_ms, 1e3 * seconds)
            # from pinned pages (the worker wrote there): an async copy, no wait for the device here
            if cpu_buf is not None:
                cpu_buf.copy_(cpu_out, non_blocking=True)
            else:
                cpu_out = cpu_out.to(self.device, non_blocking=True).to(x.dtype)
                result = cpu_out if result is None else torch.add(result, cpu_out, out=out)
        elif cpu_buf is not None:
            cpu_buf.zero_()
        if out is not None and result is not out:
            out.copy_(result)
            result = out
        end = time.perf_counter()
        for part, a, b in zip(HOST_PARTS, marks, marks[1:] + [end]):
            self.host_split[part] += b - (merged_from if part == "merge" else a)
        self.run_s += end - t_start
        return result

    def _close_step(self, layer: int, synced: float) -> None:
        """The previous layer's step ends at this layer's sync (its device side and the CPU set's
        merge are done, and this layer's attention and router ran): measured against its model when
        this layer follows it in the same forward and phase."""
        step, self._open_step = self._open_step, None
        if step is not None and self._next_layer.get(step[0]) == layer:
            _, phase, split, modelled_ms, started = step
            self.measured.observe_step(phase, split, modelled_ms, 1e3 * (synced - started))

    def _fill(self, layer: int, experts: list[int]) -> list[int]:
        """Admit the experts into slots and copy them in (copy stream) → their slots."""
        slots = [self.cache.lru.admit(layer, e)[0] for e in experts]
        self._copy_in(layer, slots, experts)
        return slots

    def device_side_ok(self, x: torch.Tensor) -> bool:
        """Whether a graph piece can hold this layer's GPU side (`gpu_side`): a few tokens on CUDA."""
        return self.device.type == "cuda" and self.gpu_set.in_place_ok(x) and (not self.forms or self.store.quantised)

    def gpu_side(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """The device half of a decode layer whose host half runs as `run(..., cpu_buf=)`: the experts
        the published map puts in slots → (N, H) in x's dtype, to which the caller adds the CPU set's
        sum; None without cache slots (cpu-only: the CPU computes everything). Device work only
        (captured)."""
        return self.gpu_set.side(layer, x, ids, weights, form=self.forms.get(layer))

    def _result_buffer(self, shape) -> torch.Tensor | None:
        """A pinned (N, H) fp32 buffer per decode size for the CPU set's result, so it returns to the
        GPU by an async copy; reused after the next layer's sync has seen that copy done. Larger
        (prefill) sets get a fresh pageable tensor."""
        if self.device.type != "cuda" or shape[0] > self.planner.max_decode_tokens:
            return None
        buf = self._cpu_out.get(shape[0])
        if buf is None:
            buf = self._cpu_out[shape[0]] = torch.empty(shape, dtype=torch.float32, pin_memory=True)
        return buf

    def _prefetch(self, layer: int, predicted: np.ndarray, depth: int) -> None:
        """Copy the next layer's predicted misses, most-routed first, into free slots or slots whose
        entry went unused through the whole last forward pass."""
        nxt = self.predictor.next_of.get(layer)
        if nxt is None:
            return
        counts = np.bincount(predicted.ravel(), minlength=self.store.n_experts)
        wanted = sorted(np.flatnonzero(counts).tolist(), key=lambda e: (-counts[e], e))
        lru = self.cache.lru
        protect = {(nxt, e) for e in wanted}
        slots, experts = [], []
        for e in wanted:
            if len(slots) >= depth:
                break
            if (nxt, e) in lru:
                continue
            slot = lru.admit_prefetch(nxt, e, self._prev_sweep_start, protect)
            if slot is None:
                break
            slots.append(slot)
            experts.append(e)
        self._copy_in(nxt, slots, experts)

    # -- reporting ------------------------------------------------------------------------------
    def hit_rate(self) -> float | None:
        lookups = sum(n for _, n in self._window)
        return sum(h for h, _ in self._window) / lookups if lookups else None

    def telemetry(self) -> dict:
        lru = self.cache.lru if self.cache is not None else None
        now = time.perf_counter()
        t0, b0 = self._rate_mark
        h2d = self.h2d_bytes  # copies into slots, plus the whole-step graph's in-place PCIe reads
        if self.zero_copy is not None:
            h2d += self.zero_copy.link_blocks * self.store.block_bytes  # in-place reads; their fills add none
        self._rate_mark = (now, h2d)
        c = lambda name: getattr(lru, name) if lru is not None else 0  # noqa: E731
        return {
            "policy": self.policy, "hits": c("hits"), "misses": c("misses") + self.uncached_misses,
            "fills": c("fills"), "cpu_executed": self.cpu_executed + (self.zero_copy.cpu_experts if self.zero_copy is not None else 0),
            "evictions": c("evictions"),
            "prefetch_issued": c("prefetches"), "prefetch_used": c("prefetch_used"),
            "prefetch_wasted": c("prefetch_wasted"), "hit_rate": self.hit_rate(),
            "slots": self.cache.n_slots if self.cache is not None else 0,
            "cache_bytes": self.cache.nbytes if self.cache is not None else 0,
            "store_bytes": self.store.nbytes, "store_pinned": self.store.pinned,
            "store_types": self.block_types() or None,
            "store_huge_pages": self.store.huge_pages, "bytes": 0,
            "cpu_kernel": self.cpu_kernel, "gpu_kernel": self._gpu_kernel(),
            "h2d_bytes": h2d, "h2d_gbps": (h2d - b0) / (now - t0) / 1e9 if now > t0 else None,
            "cpu_expert_s": self.cpu_s, "cpu_queue_s": self.cpu_queue_s, "cpu_wait_s": self.cpu_wait_s,
            "hot_table": self.hot_source,
            **self.measured.telemetry(),
            "device_wait_s": self.device_wait_s, "run_s": self.run_s,
            "host_split_s": dict(self.host_split),
            "predictor": self.predictor.accuracy() if self.predictor is not None else None,
            "zero_copy": self.zero_copy.telemetry() if self.zero_copy is not None else {"off": self.zero_copy_off},
        }

    def block_types(self) -> list[str]:
        return sorted({t for layout in self.store.layouts.values() for t in layout.types})

    def _gpu_kernel(self) -> str:
        if not self.store.quantised:
            return grouped_impl(self.device, self.store.dtype)
        return "decode over the blocks in place (quant_moe_gpu), else GEMMs over them (quant_moe_gemm_gpu)"

    def close(self, release_store: bool = True) -> None:
        if self.cache is not None:
            self.cache.synchronize()  # no copy may still read the store
        if self.zero_copy is not None:  # nor a kernel reading it in place
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.zero_copy.close()  # its CPU worker reads the store too
        self._cpu_runner.close()
        if release_store:
            self.store.close()
