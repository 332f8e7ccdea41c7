"""A, B and Δ of the roofline r(L) (seed 000 §5.2–5.3), measured through the attention kernels.

Per decode step and layer, the split attention costs
    T_CPU(r) = r·A·N + C_CPU        (CPU attention in place over the unpinned share)
    T_GPU(r) = (1−r)·B·N + C_GPU    (pinned share streamed through two ping-pong buffers)
with N the KV tokens of the step (batch × length). Both lines are fitted to the median step time
at several N: the slope is the per-token cost (A, B in ns per KV token of one layer); the fixed
per-step overhead (C_CPU, C_GPU) is the time of a 16-token step less its token cost; Δ = C_GPU − C_CPU.
The CPU step includes the round trip a real split step pays when a GPU exists (q down, partial
output and LSE up). The merge with the CPU part is r-independent and left out, as in the paper.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from engine.hw.attention_kernels import NamedKernel
from engine.kernels.lse import merge_pair
from engine.hw.hostmem import registered, touched
from engine.hw.shapes import DTYPE_BYTES, KVShape
from engine.hw.timing import GPU, fit_line, time_cpu, time_cuda

MAX_ROTATION = 64  # layers' worth of KV cycled through so small steps do not run from cache
OVERHEAD_TOKENS = 16  # the step whose time is (almost) all fixed overhead: one small block


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _rand(shape, dtype, device="cpu") -> torch.Tensor:
    """Values in [-0.5, 0.5): no NaN or denormal slows a kernel down; every page is written."""
    return torch.empty(shape, dtype=dtype, device=device).uniform_(-0.5, 0.5)


def fit_costs(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(tokens, ms) points, the first at OVERHEAD_TOKENS → (ns per token, fixed ms ≥ 0).

    The slope is fitted over all points; the fixed cost is the smallest step's time less its
    token cost, which a least-squares intercept (dominated by the noise of the long steps) is not.
    A slope of 0 or less is no measurement (a host busy during the short steps: it would make the
    tokens free, and the roofline would send all attention there): the longest step's time per token
    stands for it, an upper bound on the slope that is never 0.
    """
    slope, _ = fit_line([p[0] for p in points], [p[1] for p in points])
    if slope <= 0:
        n_max, t_max = max(points)
        slope = t_max / n_max
    n0, t0 = min(points)
    return slope * 1e6, max(t0 - slope * n0, 0.0)


def cpu_attention_points(shape: KVShape, batch: int, lengths: list[int], kernel: NamedKernel,
                         warmup: int, repeats: int, cache_bytes: int, gpu_roundtrip: bool,
                         tick: Callable[[float], None] = lambda f: None) -> list[tuple[int, float]]:
    """Median ms of one CPU attention step over batch × L tokens of per-head host KV, for each L."""
    dtype = _torch_dtype(shape.dtype)
    scale = shape.head_dim ** -0.5
    dev = torch.device(GPU) if gpu_roundtrip else torch.device("cpu")
    q = _rand((batch, shape.n_heads, 1, shape.head_dim), dtype, dev)  # (B, nh, 1, hs), where the model has it
    points = []
    for n, L in enumerate(lengths):
        layer_bytes = batch * L * shape.bytes_per_token
        copies = min(MAX_ROTATION, max(1, math.ceil(2 * cache_bytes / layer_bytes)))
        kv = [(_rand((batch, shape.n_kv_heads, L, shape.head_dim), dtype),  # (B, n_kv, L, hs) per-head layout
               _rand((batch, shape.n_kv_heads, L, shape.head_dim), dtype)) for _ in range(copies)]

        def step(i, kv=kv):
            k, v = kv[i % len(kv)]
            out, lse = kernel.fn(q.to("cpu") if gpu_roundtrip else q, k, v, scale)
            if gpu_roundtrip:  # the GPU merges: both parts travel back before the step ends
                out, lse = out.to(dev), lse.to(dev)
                torch.cuda.current_stream().synchronize()
            return out, lse

        t = time_cpu(step, warmup, repeats)
        points.append((batch * L, t.median_ms))
        del kv
        tick((n + 1) / len(lengths))
    return points


class PingPongStream:
    """The GPU side of split attention: pinned chunk-major host KV streamed through two GPU buffers,
    the copy of chunk i+1 (side stream) overlapping attention on chunk i, partials merged by LSE."""

    def __init__(self, shape: KVShape, batch: int, max_tokens: int, chunk_tokens: int, kernel: NamedKernel):
        self.shape, self.batch, self.chunk, self.kernel = shape, batch, chunk_tokens, kernel
        dtype = _torch_dtype(shape.dtype)
        self.chunk_elems = 2 * batch * shape.n_kv_heads * chunk_tokens * shape.head_dim  # K and V of one chunk
        n_chunks = math.ceil(max_tokens / chunk_tokens)
        # Chunk-major pinned load region: chunk i's K and V at [i·chunk_elems, (i+1)·chunk_elems).
        self.host = touched(n_chunks * self.chunk_elems * DTYPE_BYTES[shape.dtype], dtype).uniform_(-0.5, 0.5)
        self.buffers = [torch.empty(self.chunk_elems, dtype=dtype, device=GPU) for _ in range(2)]
        self.q = _rand((batch, shape.n_heads, 1, shape.head_dim), dtype, GPU)
        self.copy_stream = torch.cuda.Stream()
        self.ready = [torch.cuda.Event(), torch.cuda.Event()]
        self.free = [torch.cuda.Event(), torch.cuda.Event()]

    def _chunk(self, flat: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """The first n_tokens of a chunk slot as (2, B, n_kv, n, hs), contiguous."""
        s = self.shape
        return flat[: 2 * self.batch * s.n_kv_heads * n_tokens * s.head_dim].view(
            2, self.batch, s.n_kv_heads, n_tokens, s.head_dim)

    def step(self, n_tokens: int):
        """Attention of q over n_tokens per sequence streamed from the host; returns (out, lse)."""
        compute = torch.cuda.current_stream()
        self.copy_stream.wait_stream(compute)
        scale = self.shape.head_dim ** -0.5
        out = lse = None
        for i, start in enumerate(range(0, n_tokens, self.chunk)):
            n = min(self.chunk, n_tokens - start)
            b = i % 2
            src = self._chunk(self.host[i * self.chunk_elems:(i + 1) * self.chunk_elems], n)
            dst = self._chunk(self.buffers[b], n)
            with torch.cuda.stream(self.copy_stream):
                if i >= 2:
                    self.copy_stream.wait_event(self.free[b])  # attention on chunk i−2 has read the buffer
                dst.copy_(src, non_blocking=True)
                self.ready[b].record(self.copy_stream)
            compute.wait_event(self.ready[b])
            o, l = self.kernel.fn(self.q, dst[0], dst[1], scale)
            self.free[b].record(compute)
            out, lse = (o.float(), l) if out is None else merge_pair(out, lse, o.float(), l)
        return out, lse


def gpu_attention_points(shape: KVShape, batch: int, lengths: list[int], kernel: NamedKernel,
                         chunk_tokens: int, warmup: int, repeats: int,
                         tick: Callable[[float], None] = lambda f: None) -> list[tuple[int, float]]:
    """Median ms (CUDA events) of one streamed GPU attention step over batch × L tokens, for each L."""
    pp = PingPongStream(shape, batch, max(lengths), chunk_tokens, kernel)
    points = []
    with registered(pp.host):
        for n, L in enumerate(lengths):
            t = time_cuda(lambda i, L=L: pp.step(L), warmup, repeats)
            points.append((batch * L, t.median_ms))
            tick((n + 1) / len(lengths))
    return points


def fastest(passes: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Per step size, the fastest of several passes' medians. A host's slow spell (on a busy server
    host, single points 10-40x the others, a different one each run) spoils one pass's median at one
    size, and the fitted A comes out 0 or 17x too large."""
    return [(n, min(p[j][1] for p in passes)) for j, (n, _) in enumerate(passes[0])]


def kv_costs_for_batch(cpu_points, gpu_points) -> dict:
    """The fitted A, C_CPU (and B, C_GPU, Δ when the GPU side was measured) of one batch size."""
    A, c_cpu = fit_costs(cpu_points)
    out = {"A_ns_per_token": A, "C_cpu_ms": c_cpu, "cpu_points": [list(p) for p in cpu_points]}
    if gpu_points is not None:
        B, c_gpu = fit_costs(gpu_points)
        out.update(B_ns_per_token=B, C_gpu_ms=c_gpu, delta_ms=c_gpu - c_cpu,
                   gpu_points=[list(p) for p in gpu_points])
    return out
