"""WriteScope: hybrid CPU/GPU decode attention over the InplaceKVCache views (seed 000, §4.2–§5).

For one layer of one step, with the new token already appended:

    CPU worker thread   exact attention over the unpinned share, in place → (o_cpu, lse_cpu)
    GPU (this thread)   attention over the D-window, and over the pinned share streamed through
                        the two ping-pong buffers: the copy of chunk i+1 (h2d stream) overlaps
                        the attention over chunk i (compute stream), ordered by events
    merge               every part merged exactly by its LSE on the device

The CPU result is the only thing the step waits for on the host. Prefill steps add the causal
attention of the new tokens over themselves and route their KV to its final regions at write time.
Attention sinks (gpt-oss: a learned logit s_h per head in every softmax, with a zero value) enter
once, after the merge of every part: the merged output over the union of the parts, scaled by
σ(lse − s_h) with the merged LSE (attention_gpu.sink_scale), is the softmax with the sink in it.
The share r comes from the policy: `writescope` follows the roofline r(L) with online estimates of
A and B from the measured CPU and GPU times; `gpu-centric`, `cpu-centric` and `fixed:<r>` fix it.
Only decode steps feed those estimates. r(L) balances a decode step, where each placed token meets one
query row a head; a prefill chunk's T rows cost every placed token T times the compute (on the CPU
~100x A at 512 rows; far less on the GPU, whose side is bound by the link), and counting them drove r
towards 0 while the prompt's own KV was being placed, where it stays. A prompt is placed with the
decode costs known when it arrives: a calibration profile's or the setup's own timing of these kernels
(engine/kv/cost_probe.py), then what earlier decode steps measured.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from engine.kernels.attention_cpu import attend_blocks, implementation, kernel_name, prepare
from engine.kernels.attention_gpu import attend_dense, attend_padded, sink_scale
from engine.kernels import lse_gpu
from engine.kernels.lse import merge_groups, merge_pair, merge_stack
from engine.kv.backend import KVBackend
from engine.kv.inplace import InplaceKVCache, PartitionSpec, StepPlan
from engine.kv.stream_graph import StreamGraphs
from engine.kv.transport import HostExchange, Transport
from engine.sched.roofline import RooflineParams, SharePolicy


# On CUDA the GPU side and the h2d stream are timed (four events) on one layer in this many, which
# feeds the B estimator plenty while sparing the other layers' event calls.
TIMED_LAYER_STRIDE = 4


class WriteScopeKV(KVBackend):
    supports_sinks = True  # attend's sinks; a window per layer is kv/layer_split.py's (window layers stay resident)

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, max_context: int, max_batch: int,
                 device: torch.device, dtype: torch.dtype, spec: PartitionSpec, policy: str = "writescope",
                 stream_graphs: bool = True):
        """stream_graphs: on CUDA, replay each layer's streamed loads as a CUDA graph while a decode
        step's load list stays the same (engine/kv/stream_graph.py); False streams them eagerly."""
        self.policy = policy
        self.share = SharePolicy.from_name(policy, spec.roofline, spec.cost_window)
        self.transport = Transport(device)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="tandem-cpu-attention")
        self.cache = InplaceKVCache(spec, n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim,
                                    max_context=max_context, max_batch=max_batch, device=device, dtype=dtype,
                                    transport=self.transport, host_executor=self.worker)
        self.exchange = HostExchange(self.transport)
        self.device, self.dtype = device, dtype
        self.loaded = [self.transport.event(), self.transport.event()]  # ping-pong buffer i holds its chunk
        self.consumed = [self.transport.event(), self.transport.event()]  # ping-pong buffer i may be overwritten
        self.plan: StepPlan | None = None
        self.r_target: float | None = None
        self.costs_from = "defaults"  # where the estimators' starting A, B, Δ came from (calibrate)
        self.h2d_bytes = 0
        self.h2d_timed_bytes = 0  # bytes of the measured spans: on CUDA one layer in TIMED_LAYER_STRIDE
        self.h2d_seconds = 0.0  # time the h2d stream spent on measured spans
        self.h2d_gbps: float | None = None
        self._timings: deque = deque()  # CUDA: (kind, start event, end event, tokens or bytes)
        self._n_heads: int | None = None
        self._cpu_ran = False
        self._merge_rows: dict = {}  # (parts, chunks) → (P,) row of each part, for this step
        self._cpu_blocks: dict = {}  # layer → (the plan's cpu_ranges, its views prepared for the CPU kernel)
        self._pp_views = None
        self.graphs = StreamGraphs(device) if self.transport.cuda and stream_graphs else None
        self._loads_key: tuple | None = None  # this step's load list, the key of the layers' graphs

    # -- sequences ----------------------------------------------------------------------------
    def new_sequence(self) -> int:
        return self.cache.new_sequence()

    def free(self, seq_id: int) -> None:
        self.cache.free(seq_id)

    def crop(self, seq_id: int, n_tokens: int) -> None:
        self.cache.crop(seq_id, n_tokens)

    def length(self, seq_id: int) -> int:
        return self.cache.seqs[seq_id].length

    def calibrate(self, params: RooflineParams, source: str = "calibration profile") -> None:
        """Start the cost estimators from A, B, Δ measured elsewhere: a hardware profile, or the
        backend's kernels timed at setup (engine/kv/cost_probe.py). source: which, for the stats."""
        self.share.calibrate(params)
        self.costs_from = source

    # -- one step -----------------------------------------------------------------------------
    def begin_step(self, seq_ids: list[int], n_new: int) -> torch.Tensor:
        self._drain_timings()
        placed = sum(self.cache.seqs[s].placed for s in seq_ids) + n_new * len(seq_ids)
        self.r_target = self.share.target(placed)
        self.cache.before_appends()
        self.plan = plan = self.cache.plan_step(seq_ids, n_new, self.r_target)
        self._loads_key = None
        if self.graphs is not None and plan.decode and plan.chunks:
            self._loads_key = (len(seq_ids), tuple((row, tuple(pieces), n) for row, pieces, n in plan.chunks))
        return plan.positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None, sinks: torch.Tensor | None = None, window: int | None = None
               ) -> torch.Tensor:
        """scale: the softmax scale; None: hs^−½. sinks (nh,): per-head sink logits, or None.
        window: one that binds within max_context is refused: such a layer keeps its KV resident."""
        if window is not None and window < self.cache.max_context:  # a window that hides no key is full attention
            raise ValueError(f"layer {layer}: writescope attends over every past key; a {window}-token "
                             "window layer belongs in the resident part (engine/kv/layer_split.py)")
        plan = self.plan
        nh, hs = q.shape[1], q.shape[3]
        self._n_heads = nh
        scale = hs ** -0.5 if scale is None else scale
        compute = self.transport.compute_stream()
        cpu = None
        if plan.cpu_tokens:  # the CPU starts first (it reads placed tokens only); the GPU parts run meanwhile
            q_host, ready = self.exchange.to_host(q, self.dtype, compute)
            cpu = self.worker.submit(self._cpu_part, layer, plan, q_host, ready, scale)
            self._cpu_ran = True
        try:
            self.cache.append(layer, plan, k, v)
            timed = plan.stream_tokens and (layer % TIMED_LAYER_STRIDE == 0 or not self.transport.cuda)
            timing = self._start_timing(compute) if timed and plan.decode else None  # B: decode's cost
            parts = []  # (o (B, nh, T, hs), lse (B, nh, T) fp32) with every row
            fp32 = not self.transport.cuda  # on CUDA the merge kernel reads q's dtype and casts
            if plan.window_max:
                wk, wv = self.cache.window_views(layer, plan)
                parts.append(self.device_part(q, wk, wv, scale, excluded=plan.window_excluded, fp32=fp32))
            if not plan.decode:  # the new tokens over themselves
                parts.append(self.device_part(q, k, v, scale, causal=True, fp32=fp32))
            chunks = self._stream(layer, q, plan, scale, compute, fp32, timed) if plan.chunks else []
            if timing is not None:
                self._end_timing(timing, plan, compute)
            self.cache.flush(layer, plan, k, v)  # write-time routing of this layer, while the CPU works
        except BaseException:
            if cpu is not None:  # the CPU side still reads this step's views: let it finish before the step is undone
                wait([cpu])
            raise
        if cpu is not None:
            (slot, out, lse), seconds = cpu.result()
            parts.append(self.exchange.to_device(slot, out, lse, compute))
            if plan.decode:  # A and B are a decode step's costs (module docstring)
                self.share.A.observe(plan.cpu_tokens, seconds)
        return self._merge(plan, parts, chunks, q.dtype, sinks)

    def end_step(self) -> None:
        plan, self.plan = self.plan, None
        self._merge_rows.clear()
        self.cache.finish(plan)
        self.cache.commit(plan)

    # -- the parts ----------------------------------------------------------------------------
    def _out_width(self, q: torch.Tensor) -> int:
        """Last dim of a part's output: a head's value width, here q's."""
        return q.shape[-1]

    @torch.inference_mode()
    def _cpu_part(self, layer: int, plan: StepPlan, q_host: torch.Tensor, ready, scale: float):
        ready.synchronize()
        B, nh, T, _ = q_host.shape
        slot, out, lse = self.exchange.result_buffers((B, nh, T, self._out_width(q_host)))
        ranges, blocks = self._cpu_blocks.get(layer, (None, None))
        if ranges != plan.cpu_ranges:  # the CPU share changed (a flush, crop or new row): new views
            blocks = self.prepare_cpu(self.cache.cpu_views(layer, plan), nh)
            self._cpu_blocks[layer] = (plan.cpu_ranges, blocks)
        t0 = time.perf_counter()
        out, lse = self.attend_cpu(q_host, blocks, scale, out=out, lse=lse)
        seconds = time.perf_counter() - t0
        return (slot, out, lse), seconds

    # -- the kernels of each side, which cost_probe.py also times -------------------------------
    @property
    def query_width(self) -> int:
        """Last dim of a query row: a head's width here."""
        return self.cache.head_dim

    def prepare_cpu(self, views: list[list[tuple[torch.Tensor, torch.Tensor]]], n_heads: int):
        """Per row, (k, v) host views (n_kv, t, hs) → what attend_cpu reads."""
        implementation(self.dtype, n_heads, self.cache.n_kv, self.cache.head_dim)  # first call: probe, untimed
        return prepare(views)

    def attend_cpu(self, q_host: torch.Tensor, blocks, scale: float, *, out=None, lse=None):
        """The CPU kernel: q_host (B, nh, T, w) over prepared blocks → (o, lse)."""
        return attend_blocks(q_host, blocks, scale, out=out, lse=lse)

    def device_part(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool = False,
                    excluded: torch.Tensor | None = None, fp32: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One device-side part (D-window, new tokens, a ping-pong load) → (o, lse): per-head K and V
        here; a cache of other rows (engine/kv/latent.py) computes it its own way."""
        if excluded is not None:
            return attend_padded(q, k, v, excluded, scale)
        return attend_dense(q, k, v, scale, causal=causal, fp32=fp32)

    def pingpong_views(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ping-pong buffer j's K and V as (1, n_kv, G·E, hs) views."""
        return self._pingpong_kv[j]

    def _stream(self, layer: int, q: torch.Tensor, plan: StepPlan, scale: float, compute, fp32: bool,
                timed: bool) -> list:
        """The pinned share through the ping-pong buffers: copy of chunk i+1 overlaps compute on i.
        → (o, lse) per load, or one (o (P, nh, T, hs), lse (P, nh, T)) for all P loads when a graph
        ran them."""
        tr, cache, key = self.transport, self.cache, self._loads_key
        if key is not None:
            graph = self.graphs.find(layer, key)
            if graph is None and (dtype := self.graphs.ready_to_capture(layer, key)) is not None:
                def body(q_static, stream, fork):  # the capture's own events: nothing recorded outside it is waited on
                    loaded, consumed = [torch.cuda.Event() for _ in range(2)], [torch.cuda.Event() for _ in range(2)]
                    return self._loads(layer, q_static, plan, scale, stream, fp32, loaded, consumed, fork)
                graph = self.graphs.capture(layer, key, q, len(plan.chunks), dtype, body, self._out_width(q))
            if graph is not None:
                tr.wait(compute, cache.d2h_done)  # extents written back by an earlier flush have landed
                span = self._span_start(compute) if timed else None
                part = self.graphs.replay(graph, q)
                for ev in self.consumed:  # eager loads later overwrite a buffer only after the graph read it
                    ev.record(compute)
                self._count_streamed(plan, span)
                return [part]
        tr.wait(tr.h2d, cache.d2h_done)
        span = self._span_start(tr.h2d) if timed else None
        parts = self._loads(layer, q, plan, scale, compute, fp32, self.loaded, self.consumed)
        self._count_streamed(plan, span)
        if key is not None:
            self.graphs.seen(layer, key, parts[0][0].dtype)
        return parts

    def _loads(self, layer: int, q: torch.Tensor, plan: StepPlan, scale: float, compute, fp32: bool,
               loaded: list, consumed: list, first=None) -> list:
        """The loop itself → one (o (1, nh, T, hs), lse (1, nh, T)) per load. On a slow host each
        torch call costs tens of µs, so it keeps to the calls it needs (events recorded on named
        streams, K/V views of each buffer made once). `first`: the event the first two loads wait
        for instead of `consumed` (a graph capture's fork)."""
        tr, cache, h2d = self.transport, self.cache, self.transport.h2d
        parts = []
        for i, (row, pieces, n) in enumerate(plan.chunks):
            j = i & 1
            buf = cache.pingpong[j]
            with tr.on(h2d, compute):
                tr.wait(h2d, first if first is not None and i < 2 else consumed[j])  # the buffer's last reader is done
                at = 0
                for ext, m in pieces:  # one DMA per extent-layer
                    buf[at:at + m].copy_(cache.pinned_slab(layer, ext, m), non_blocking=True)
                    at += m
                loaded[j].record(h2d)
            tr.wait(compute, loaded[j])
            k, v = self._pingpong_kv[j]  # (1, n_kv, G·E, hs) views
            parts.append(self.device_part(q[row:row + 1], k[:, :, :n], v[:, :, :n], scale, fp32=fp32))
            consumed[j].record(compute)
        return parts

    def _count_streamed(self, plan: StepPlan, span) -> None:
        self.h2d_bytes += plan.stream_tokens * self.cache.token_bytes
        if span is not None:
            self._span_end(span, plan.stream_tokens * self.cache.token_bytes)

    @property
    def _pingpong_kv(self):
        """Per ping-pong buffer (G·E, 2, n_kv, hs): its K and V as (1, n_kv, G·E, hs) views."""
        if self._pp_views is None:
            self._pp_views = [(b[:, 0].transpose(0, 1).unsqueeze(0), b[:, 1].transpose(0, 1).unsqueeze(0))
                              for b in self.cache.pingpong]
        return self._pp_views

    def _merge(self, plan: StepPlan, parts: list, chunks: list, dtype: torch.dtype,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Every part by its LSE, then the sinks → o (B, nh, T, hs) in `dtype`. A sink is a key of
        logit s_h and a zero value in every row: it adds e^s_h to the merged softmax's denominator
        and nothing to its numerator, so it scales the merged output by σ(lse − s_h) with the merged
        LSE, one elementwise pass whatever the number of parts."""
        out, lse = self._merge_parts(plan, parts, chunks, dtype)
        if sinks is not None:  # (B, nh, T, hs) · σ(lse − s) (B, nh, T)
            out = out * sink_scale(lse.float(), sinks[:, None]).unsqueeze(-1).to(out.dtype)
        return out.to(dtype)

    def _merge_parts(self, plan: StepPlan, parts: list, chunks: list, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every part by its LSE → (o (B, nh, T, hs), lse (B, nh, T) fp32); o in `dtype` or fp32.
        Each row has at least one finite part (the D-window in decode, the new tokens in prefill).
        On CUDA: one cat of outputs, one of LSEs and one merge kernel, whatever the number of parts.
        A single part holds every key of every row (a first prefill, or a decode still inside its
        D-window): it is the result as it is, which spares a 32K prefill a copy and a merge pass over
        its output (~0.5 ms a layer on an H200)."""
        B = len(plan.seqs)
        if len(parts) + len(chunks) == 1 and (parts or chunks)[0][0].shape[0] == B:
            return (parts or chunks)[0]
        cuda = self.transport.cuda and lse_gpu.available(parts[0][0] if parts else chunks[0][0])
        if not cuda and not chunks and len(parts) <= 2:
            return parts[0] if len(parts) == 1 else merge_pair(*parts[0], *parts[1])
        every = parts + chunks
        outs = torch.cat([p[0] for p in every])  # (P, nh, T, hs), fp32 when any part is
        lses = torch.cat([p[1] for p in every])  # (P, nh, T)
        if not cuda and B == 1:
            out, lse = merge_stack(outs, lses)
            return out.unsqueeze(0), lse.unsqueeze(0)
        key = (len(parts), len(chunks))
        rows = self._merge_rows.get(key)
        if rows is None:  # the row of each part, the same for every layer of the step: built once
            rows = torch.arange(B, device=self.device).repeat(len(parts))
            if chunks:
                rows = torch.cat([rows, plan.chunk_rows])
            self._merge_rows[key] = rows
        if cuda:
            return lse_gpu.merge_rows(outs, lses, rows, B, dtype)
        return merge_groups(outs, lses, rows, B)

    # -- timing: the GPU side for the B estimator, the h2d stream for its achieved rate -----------
    def _event(self, stream):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def _start_timing(self, compute):
        return self._event(compute) if self.transport.cuda else time.perf_counter()

    def _end_timing(self, start, plan: StepPlan, compute) -> None:
        if not plan.stream_tokens:
            return
        if self.transport.cuda:
            self._timings.append(("gpu", start, self._event(compute), plan.stream_tokens))
        else:
            self.share.B.observe(plan.stream_tokens, time.perf_counter() - start)

    def _span_start(self, stream):
        """On the h2d stream when the loads run eagerly; on the compute stream around a graph's replay
        (which then counts its attention calls too, so the rate is a lower bound)."""
        return (self._event(stream), stream) if self.transport.cuda else time.perf_counter()

    def _span_end(self, start, nbytes: int) -> None:
        self.h2d_timed_bytes += nbytes
        if self.transport.cuda:
            start, stream = start
            self._timings.append(("h2d", start, self._event(stream), nbytes))
        else:
            seconds = time.perf_counter() - start
            self.h2d_seconds += seconds
            self.h2d_gbps = nbytes / max(seconds, 1e-9) / 1e9

    def _drain_timings(self) -> None:
        """Read the GPU timings that have completed (no host sync: unfinished ones wait a step)."""
        while self._timings and self._timings[0][2].query():
            kind, start, end, amount = self._timings.popleft()
            seconds = start.elapsed_time(end) / 1e3
            if kind == "gpu":
                self.share.B.observe(amount, seconds)
            else:
                self.h2d_seconds += seconds
                self.h2d_gbps = amount / max(seconds, 1e-9) / 1e9

    # -- stats and teardown -------------------------------------------------------------------
    def telemetry(self) -> dict:
        tokens = self.cache.tokens()
        placed = tokens["pinned"] + tokens["unpinned"]
        cache = self.cache
        return {
            "policy": self.policy,
            "simulated": not self.transport.cuda,
            "bytes": cache.nbytes(),
            "tokens": tokens,
            "r_target": self.r_target,
            "r_deployed": tokens["unpinned"] / placed if placed else None,
            "A_ns_per_token": self.share.A.per_token_ns,
            "B_ns_per_token": self.share.B.per_token_ns,
            "delta_ms": self.share.delta_ms,
            "costs_from": self.costs_from,  # and the A, B (ns) the estimators started from:
            "costs_start": (self.share.A.initial_ns, self.share.B.initial_ns),
            "pcie": {"h2d_bytes": self.h2d_bytes, "d2h_bytes": cache.d2h_bytes, "h2d_gbps": self.h2d_gbps},
            "cpu_kernel": kernel_name(self.dtype, self._n_heads, cache.n_kv, cache.head_dim) if self._cpu_ran else None,
            "stream_graphs": self.graphs.telemetry() if self.graphs is not None else None,
        }

    def synchronize(self) -> None:
        """Wait until every queued copy (host writes on the CPU side's thread, device streams) is
        done and its timing read."""
        self.worker.submit(lambda: None).result()
        self.transport.synchronize()
        self._drain_timings()

    def close(self) -> None:
        self.worker.shutdown(wait=True)
        self.transport.synchronize()
        if self.graphs is not None:  # its copies read the load region: gone before the region is
            self.graphs.close()
        self.exchange.close()
        self.cache.close()
