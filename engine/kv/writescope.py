"""WriteScope: hybrid CPU/GPU decode attention over the InplaceKVCache views (seed 000, §4.2–§5).

For one layer of one step, with the new token already appended:

    CPU worker thread   exact attention over the unpinned share, in place → (o_cpu, lse_cpu)
    GPU (this thread)   attention over the D-window, and over the pinned share streamed through
                        the two ping-pong buffers: the copy of chunk i+1 (h2d stream) overlaps
                        the attention over chunk i (compute stream), ordered by events
    merge               every part merged exactly by its LSE on the device

The CPU result is the only thing the step waits for on the host. Prefill steps add the causal
attention of the new tokens over themselves and route their KV to its final regions at write time.
The share r comes from the policy: `writescope` follows the roofline r(L) with online estimates of
A and B from the measured CPU and GPU times; `gpu-centric`, `cpu-centric` and `fixed:<r>` fix it.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from engine.kernels.attention_cpu import attend_blocks, implementation, kernel_name
from engine.kernels.attention_gpu import attend_dense, attend_padded
from engine.kernels.lse import merge_groups, merge_pair, merge_stack
from engine.kv.backend import KVBackend
from engine.kv.inplace import InplaceKVCache, PartitionSpec, StepPlan
from engine.kv.transport import NullEvent, Transport
from engine.sched.roofline import RooflineParams, SharePolicy


class HostExchange:
    """Queries to the host and CPU results back to the device, through exact-size page-locked
    buffers on CUDA (async both ways); in simulate mode the tensors pass as they are."""

    def __init__(self, transport: Transport):
        self.tr = transport
        self._q = None  # HostBuffer, flat, in the KV dtype
        self._res = None  # HostBuffer, flat fp32: out then lse
        self.result_free = transport.event()  # the last staged result has been copied to the device

    def _flat(self, holder: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        buf = getattr(self, holder)
        if buf is None or buf.tensor.numel() < n or buf.tensor.dtype != dtype:
            if buf is not None:
                buf.release()
            buf = self.tr.host((max(n, 1 << 16),), dtype, pinned=True)
            setattr(self, holder, buf)
        return buf.tensor

    def to_host(self, q: torch.Tensor, dtype: torch.dtype):
        """q (B, nh, T, hs) on the device → (host tensor, event after which it is readable)."""
        if not self.tr.cuda:
            return q.to(dtype), NullEvent()
        host = self._flat("_q", q.numel(), dtype)[:q.numel()].view(q.shape)
        host.copy_(q, non_blocking=True)
        ready = self.tr.event()
        ready.record()
        return host, ready

    def stage(self, out: torch.Tensor, lse: torch.Tensor):
        """Worker side: CPU results into the page-locked buffer (once the last one has left it)."""
        if not self.tr.cuda:
            return out, lse
        self.result_free.synchronize()
        flat = self._flat("_res", out.numel() + lse.numel(), torch.float32)
        o = flat[:out.numel()].view(out.shape)
        lo = flat[out.numel():out.numel() + lse.numel()].view(lse.shape)
        o.copy_(out)
        lo.copy_(lse)
        return o, lo

    def close(self) -> None:
        for buf in (self._q, self._res):
            if buf is not None:
                buf.release()
        self._q = self._res = None

    def to_device(self, staged):
        if not self.tr.cuda:
            return staged
        o, lo = (t.to(self.tr.device, non_blocking=True) for t in staged)
        self.result_free.record()
        return o, lo


class WriteScopeKV(KVBackend):
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, max_context: int, max_batch: int,
                 device: torch.device, dtype: torch.dtype, spec: PartitionSpec, policy: str = "writescope"):
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
        self.h2d_bytes = 0
        self.h2d_seconds = 0.0  # time the h2d stream spent on measured spans
        self.h2d_gbps: float | None = None
        self._timings: deque = deque()  # CUDA: (kind, start event, end event, tokens or bytes)
        self._n_heads: int | None = None
        self._cpu_ran = False

    # -- sequences ----------------------------------------------------------------------------
    def new_sequence(self) -> int:
        return self.cache.new_sequence()

    def free(self, seq_id: int) -> None:
        self.cache.free(seq_id)

    def crop(self, seq_id: int, n_tokens: int) -> None:
        self.cache.crop(seq_id, n_tokens)

    def length(self, seq_id: int) -> int:
        return self.cache.seqs[seq_id].length

    def calibrate(self, params: RooflineParams) -> None:
        """Start the cost estimators from calibrated A, B, Δ (a hardware profile)."""
        self.share.calibrate(params)

    # -- one step -----------------------------------------------------------------------------
    def begin_step(self, seq_ids: list[int], n_new: int) -> torch.Tensor:
        self._drain_timings()
        placed = sum(self.cache.seqs[s].placed for s in seq_ids) + n_new * len(seq_ids)
        self.r_target = self.share.target(placed)
        self.cache.before_appends()
        self.plan = self.cache.plan_step(seq_ids, n_new, self.r_target)
        return self.plan.positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        nh, hs = q.shape[1], q.shape[3]
        self._n_heads = nh
        scale = hs ** -0.5
        self.cache.append(layer, plan, k, v)
        cpu = None
        if plan.cpu_tokens:  # the CPU starts first; the GPU parts below run meanwhile
            q_host, ready = self.exchange.to_host(q, self.dtype)
            cpu = self.worker.submit(self._cpu_part, layer, plan, q_host, ready, scale)
            self._cpu_ran = True
        try:
            timing = self._start_timing() if plan.stream_tokens else None
            parts = []  # (o (B, nh, T, hs) fp32, lse (B, nh, T)) with every row
            if plan.window_max:
                wk, wv = self.cache.window_views(layer, plan)
                if plan.window_excluded is None:
                    parts.append(attend_dense(q, wk, wv, scale))
                else:
                    parts.append(attend_padded(q, wk, wv, plan.window_excluded, scale))
            if not plan.decode:  # the new tokens over themselves
                parts.append(attend_dense(q, k, v, scale, causal=True))
            chunks = self._stream(layer, q, plan, scale) if plan.chunks else None
            self._end_timing(timing, plan)
            self.cache.flush(layer, plan, k, v)  # write-time routing of this layer, while the CPU works
        except BaseException:
            if cpu is not None:  # the CPU side still reads this step's views: let it finish before the step is undone
                wait([cpu])
            raise
        if cpu is not None:
            staged, seconds = cpu.result()
            parts.append(self.exchange.to_device(staged))
            self.share.A.observe(plan.cpu_tokens, seconds)
        return self._merge(plan, parts, chunks).to(q.dtype)

    def end_step(self) -> None:
        plan, self.plan = self.plan, None
        self.cache.finish(plan)
        self.cache.commit(plan)

    # -- the parts ----------------------------------------------------------------------------
    @torch.inference_mode()
    def _cpu_part(self, layer: int, plan: StepPlan, q_host: torch.Tensor, ready, scale: float):
        ready.synchronize()
        implementation(self.dtype, q_host.shape[1], self.cache.n_kv, self.cache.head_dim)  # first call: probe, untimed
        t0 = time.perf_counter()
        out, lse = attend_blocks(q_host, self.cache.cpu_views(layer, plan), scale)
        seconds = time.perf_counter() - t0
        return self.exchange.stage(out, lse), seconds

    def _stream(self, layer: int, q: torch.Tensor, plan: StepPlan, scale: float):
        """The pinned share through the ping-pong buffers: copy of chunk i+1 overlaps compute on i."""
        tr, cache = self.transport, self.cache
        compute = tr.compute_stream()
        tr.wait(tr.h2d, cache.d2h_done)  # extents written back by an earlier flush have landed
        span = self._span_start()
        outs, lses = [], []
        for i, (row, ext, n) in enumerate(plan.chunks):
            j = i & 1
            buf = cache.pingpong[j]
            with tr.on(tr.h2d):
                tr.wait(tr.h2d, self.consumed[j])  # attention over this buffer's previous chunk is done
                buf[:n].copy_(cache.pinned_slab(layer, ext, n), non_blocking=True)  # one DMA
                self.loaded[j].record(tr.h2d)
            tr.wait(compute, self.loaded[j])
            kv = buf[:n]  # (n, 2, n_kv, hs)
            o, lse = attend_dense(q[row:row + 1], kv[:, 0].transpose(0, 1).unsqueeze(0),
                                  kv[:, 1].transpose(0, 1).unsqueeze(0), scale)
            self.consumed[j].record(compute)
            outs.append(o)
            lses.append(lse)
        self._span_end(span, plan.stream_tokens * cache.token_bytes)
        return torch.cat(outs), torch.cat(lses)  # (P, nh, T, hs), (P, nh, T)

    def _merge(self, plan: StepPlan, parts: list, chunks) -> torch.Tensor:
        """Every part by its LSE: o (B, nh, T, hs) fp32. Each row has at least one finite part (the
        D-window in decode, the new tokens in prefill)."""
        if chunks is None and len(parts) <= 2:
            out, lse = parts[0]
            if len(parts) == 2:
                out, lse = merge_pair(out, lse, *parts[1])
            return out
        B = len(plan.seqs)
        outs = torch.cat([p[0] for p in parts] + ([chunks[0]] if chunks else []))  # (P, nh, T, hs)
        lses = torch.cat([p[1] for p in parts] + ([chunks[1]] if chunks else []))  # (P, nh, T)
        if B == 1:
            return merge_stack(outs, lses)[0].unsqueeze(0)
        rows = torch.arange(B, device=self.device).repeat(len(parts))
        if chunks is not None:
            rows = torch.cat([rows, plan.chunk_rows])
        return merge_groups(outs, lses, rows, B)[0]

    # -- timing: the GPU side for the B estimator, the h2d stream for its achieved rate -----------
    def _event(self, stream=None):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def _start_timing(self):
        return self._event() if self.transport.cuda else time.perf_counter()

    def _end_timing(self, start, plan: StepPlan) -> None:
        if not plan.stream_tokens:
            return
        if self.transport.cuda:
            self._timings.append(("gpu", start, self._event(), plan.stream_tokens))
        else:
            self.share.B.observe(plan.stream_tokens, time.perf_counter() - start)

    def _span_start(self):
        return self._event(self.transport.h2d) if self.transport.cuda else time.perf_counter()

    def _span_end(self, start, nbytes: int) -> None:
        self.h2d_bytes += nbytes
        if self.transport.cuda:
            self._timings.append(("h2d", start, self._event(self.transport.h2d), nbytes))
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
            "pcie": {"h2d_bytes": self.h2d_bytes, "d2h_bytes": cache.d2h_bytes, "h2d_gbps": self.h2d_gbps},
            "cpu_kernel": kernel_name(self.dtype, self._n_heads, cache.n_kv, cache.head_dim) if self._cpu_ran else None,
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
        self.exchange.close()
        self.cache.close()
