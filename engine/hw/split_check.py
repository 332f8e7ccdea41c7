"""Does r(L) from the calibrated A, B, Δ land on the fastest split? (seed 000 §7.6, Fig. 12 method)

For each context length L, run the split decode-attention step at a grid of fixed CPU shares r —
the CPU computes over r·L tokens of per-head host KV in a worker thread while the GPU streams the
other (1−r)·L tokens through the ping-pong buffers, then the GPU merges both by LSE — and take the
fastest r. Compare it with the roofline's r(L) = clamp(B/(A+B) + Δ/((A+B)·N)) (N = batch·L) and
time the step at that predicted share too, so the cost of any deviation is visible in ms.

This is the calibration harness (the same kernels and pipeline that produced A and B), not the
engine's WriteScope path; `tandem bench` repeats the comparison through the engine.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from engine.hw.attention_kernels import NamedKernel
from engine.kernels.lse import merge_pair
from engine.hw.hostmem import registered
from engine.hw.kv_costs import PingPongStream, _rand
from engine.hw.shapes import KVShape
from engine.hw.timing import GPU

R_GRID = tuple(i / 10 for i in range(11))


def roofline_share(A_ns: float, B_ns: float, delta_ms: float, tokens: int) -> float:
    """r(L) of seed 000 Eq. (2), with A, B in ns per token and `tokens` the step's KV tokens."""
    r = B_ns / (A_ns + B_ns) + delta_ms * 1e6 / ((A_ns + B_ns) * tokens)
    return min(1.0, max(0.0, r))


class SplitStep:
    """One layer's split decode-attention step over `batch` sequences of up to max_tokens each."""

    def __init__(self, shape: KVShape, batch: int, max_tokens: int, chunk_tokens: int,
                 cpu_kernel: NamedKernel, gpu_kernel: NamedKernel):
        self.shape, self.cpu_kernel = shape, cpu_kernel
        dtype = getattr(torch, shape.dtype)
        self.pp = PingPongStream(shape, batch, max_tokens, chunk_tokens, gpu_kernel)
        kv_shape = (batch, shape.n_kv_heads, max_tokens, shape.head_dim)  # (B, n_kv, L, hs) unpinned region
        self.k, self.v = _rand(kv_shape, dtype), _rand(kv_shape, dtype)
        self.pool = ThreadPoolExecutor(max_workers=1)

    def _cpu_part(self, q: torch.Tensor, n: int):
        return self.cpu_kernel.fn(q, self.k[:, :, :n], self.v[:, :, :n], self.shape.head_dim ** -0.5)

    def run(self, tokens: int, r: float) -> float:
        """Wall ms of one step with round(r·tokens) tokens on the CPU, merged on the GPU."""
        n_cpu = int(round(r * tokens))
        n_gpu = tokens - n_cpu
        t0 = time.perf_counter()
        # q goes down before any GPU work is queued: a copy queued behind the GPU part would wait for it.
        future = self.pool.submit(self._cpu_part, self.pp.q.to("cpu"), n_cpu) if n_cpu else None
        out, lse = self.pp.step(n_gpu) if n_gpu else (None, None)
        if future is not None:
            c_out, c_lse = future.result()
            c_out, c_lse = c_out.to(GPU, non_blocking=True), c_lse.to(GPU, non_blocking=True)
            out, lse = (c_out, c_lse) if out is None else merge_pair(out, lse, c_out.float(), c_lse)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    def median_ms(self, tokens: int, r: float, warmup: int, repeats: int) -> float:
        for _ in range(warmup):
            self.run(tokens, r)
        return statistics.median(self.run(tokens, r) for _ in range(repeats))

    def close(self) -> None:
        self.pool.shutdown()


def check(shape: KVShape, batch: int, lengths: list[int], costs: dict, cpu_kernel: NamedKernel,
          gpu_kernel: NamedKernel, chunk_tokens: int, warmup: int, repeats: int,
          tick: Callable[[float], None] = lambda f: None) -> dict:
    """Measured best r vs predicted r(L) at each L, for one batch size's fitted costs."""
    step = SplitStep(shape, batch, max(lengths), chunk_tokens, cpu_kernel, gpu_kernel)
    rows = []
    try:
        with registered(step.pp.host):
            for j, L in enumerate(lengths):
                ms = [step.median_ms(L, r, warmup, repeats) for r in R_GRID]
                best = min(range(len(R_GRID)), key=ms.__getitem__)
                predicted = roofline_share(costs["A_ns_per_token"], costs["B_ns_per_token"], costs["delta_ms"],
                                           batch * L)
                at_predicted = step.median_ms(L, predicted, warmup, repeats)
                rows.append({"L": L, "r_best": R_GRID[best], "ms_best": ms[best], "r_predicted": predicted,
                             "ms_at_predicted": at_predicted, "deviation": abs(predicted - R_GRID[best]),
                             "slowdown_at_predicted": at_predicted / ms[best] - 1.0,
                             "ms_by_r": [[r, t] for r, t in zip(R_GRID, ms)]})
                tick((j + 1) / len(lengths))
    finally:
        step.close()
    return {"batch": batch, "rows": rows,
            "method": "fixed-share sweep r = 0, 0.1 … 1 of the calibration harness's split step (CPU worker "
                      "thread + GPU ping-pong stream + LSE merge), wall-clock median; r_predicted from this "
                      "profile's A, B, Δ"}
