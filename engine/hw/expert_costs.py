"""Expert costs for the miss planner: the CPU and GPU cost table by tokens per expert (seed 001
§4.3: t_c(n), t_g, t_io), and the bandwidths of seed 004's miss split — B_P (pinned expert fills
over PCIe), B_H (host expert processing), B_R = max(B_H − B_P, 0) — also measured while a fill
stream and CPU experts run at the same time, which is when the split happens.

An expert is stored as the engine stores it: one contiguous host buffer [gate_up (2I, H) | down
(H, I)], so one fill is one DMA and the CPU computes on views of the same bytes. The expert kernel
is injectable: `kernel(x (n, H), gate_up (2I, H), down (H, I)) -> (n, H)`.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from engine.hw.hostmem import PAGE, registered, touched
from engine.hw.shapes import DTYPE_BYTES, ExpertShape
from engine.hw.timing import GPU, time_cpu, time_cuda
from engine.kernels.experts_torch import expert_ffn

ExpertKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MAX_EXPERTS = 32  # distinct experts cycled through, so repeated calls do not run from cache


def rotation(expert_bytes: int, cache_bytes: int) -> int:
    """Experts to cycle through so that their weights exceed twice the cache."""
    return min(MAX_EXPERTS, max(2, math.ceil(2 * cache_bytes / expert_bytes)))


class ExpertStore:
    """`count` experts of `shape` in one buffer on `device`, each a page-aligned flat slot (on the
    host the buffer is what gets page-locked, once)."""

    def __init__(self, shape: ExpertShape, count: int, device: str = "cpu"):
        self.shape = shape
        dtype = getattr(torch, shape.dtype)
        n = 3 * shape.hidden * shape.ffn  # elements of one expert
        stride = -(-shape.bytes_per_expert // PAGE) * PAGE // DTYPE_BYTES[shape.dtype]  # elements per slot
        if device == "cpu":
            self.buffer = touched(count * stride * DTYPE_BYTES[shape.dtype], dtype)
        else:
            self.buffer = torch.empty(count * stride, dtype=dtype, device=device)
        # Scaled like trained weights, so activations stay finite whatever the token count.
        self.buffer.uniform_(-0.02, 0.02)
        self.flat = [self.buffer[e * stride:e * stride + n] for e in range(count)]

    def views(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        H, I = self.shape.hidden, self.shape.ffn
        flat = self.flat[e % len(self.flat)]
        return flat[: 2 * I * H].view(2 * I, H), flat[2 * I * H:].view(H, I)


def cpu_expert_points(store: ExpertStore, tokens: list[int], kernel: ExpertKernel, warmup: int, repeats: int,
                      tick: Callable[[float], None] = lambda f: None) -> list[dict]:
    """Median ms of one expert applied to n tokens on the CPU, for each n."""
    points = []
    for j, n in enumerate(tokens):
        x = torch.empty(n, store.shape.hidden, dtype=store.flat[0].dtype).uniform_(-1, 1)  # (n, H)
        t = time_cpu(lambda i, x=x: kernel(x, *store.views(i)), warmup, repeats)
        points.append({"tokens": n, "ms": t.median_ms})
        tick((j + 1) / len(tokens))
    return points


def gpu_expert_points(store: ExpertStore, tokens: list[int], kernel: ExpertKernel, warmup: int, repeats: int,
                      tick: Callable[[float], None] = lambda f: None) -> list[dict]:
    """Median ms (CUDA events) of one expert applied to n tokens on the GPU, weights in VRAM."""
    points = []
    for j, n in enumerate(tokens):
        x = torch.empty(n, store.shape.hidden, dtype=store.flat[0].dtype, device=GPU).uniform_(-1, 1)
        t = time_cuda(lambda i, x=x: kernel(x, *store.views(i)), warmup, repeats)
        points.append({"tokens": n, "ms": t.median_ms})
        tick((j + 1) / len(tokens))
    return points


def fill_ms(store: ExpertStore, warmup: int, repeats: int) -> float:
    """Median ms (CUDA events) of one expert fill: pinned host buffer → GPU slot, on a side stream.
    The store must be registered (page-locked) by the caller."""
    slot = torch.empty_like(store.flat[0], device=GPU)
    stream = torch.cuda.Stream()
    return time_cuda(lambda i: slot.copy_(store.flat[i % len(store.flat)], non_blocking=True),
                     warmup, repeats, stream).median_ms


def concurrent_bandwidths(store: ExpertStore, kernel: ExpertKernel, solo_fill_ms: float, duration_ms: float) -> dict:
    """Fills stream on a side stream while this thread computes experts on one token each; both
    run for about duration_ms. Returns what each achieved under the other's load."""
    nbytes = store.flat[0].numel() * store.flat[0].element_size()
    n_fills = max(8, math.ceil(duration_ms / max(solo_fill_ms, 1e-3)))
    slots = [torch.empty_like(store.flat[0], device=GPU) for _ in range(2)]
    stream = torch.cuda.Stream()
    x = torch.empty(1, store.shape.hidden, dtype=store.flat[0].dtype).uniform_(-1, 1)  # (1, H): a decode token
    kernel(x, *store.views(0))  # warm the CPU path
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for j in range(n_fills):
            slots[j % 2].copy_(store.flat[j % len(store.flat)], non_blocking=True)
        end.record(stream)
    done, t0 = 0, time.perf_counter()
    while done == 0 or not end.query():  # CPU experts for as long as the fills run (at least one)
        kernel(x, *store.views(done))
        done += 1
    cpu_s = time.perf_counter() - t0
    end.synchronize()
    copy_ms = start.elapsed_time(end)
    return {"B_P_GBps": n_fills * nbytes / (copy_ms * 1e-3) / 1e9,
            "B_H_GBps": done * nbytes / cpu_s / 1e9,
            "fill_ms": copy_ms / n_fills, "cpu_ms_per_expert": cpu_s * 1e3 / done,
            "fills": n_fills, "cpu_experts": done}


def measure(shape: ExpertShape, tokens: list[int], cache_bytes: int, gpu_cache_bytes: int | None,
            warmup: int, repeats: int, concurrency_ms: float, cpu_kernel: ExpertKernel = expert_ffn,
            gpu_kernel: ExpertKernel = expert_ffn, tick: Callable[[float], None] = lambda f: None) -> dict:
    """The expert section of a profile for one expert shape (GPU parts only when CUDA exists)."""
    nbytes = shape.bytes_per_expert
    store = ExpertStore(shape, rotation(nbytes, cache_bytes))
    cpu = cpu_expert_points(store, tokens, cpu_kernel, warmup, repeats, lambda f: tick(0.4 * f))
    one = min(cpu, key=lambda p: p["tokens"])
    out: dict = {"bytes_per_expert": nbytes, "experts_cycled": len(store.flat), "threads": torch.get_num_threads(),
                 "cpu_ms": cpu, "B_H_GBps": nbytes / (one["ms"] * 1e-3) / 1e9}
    if gpu_cache_bytes is None:
        return out
    gpu_store = ExpertStore(shape, rotation(nbytes, gpu_cache_bytes), device=GPU)
    out["gpu_ms"] = gpu_expert_points(gpu_store, tokens, gpu_kernel, warmup, repeats, lambda f: tick(0.4 + 0.3 * f))
    del gpu_store
    with registered(store.buffer):
        out["fill_ms"] = fill_ms(store, warmup, repeats)
        tick(0.8)
        out["B_P_GBps"] = nbytes / (out["fill_ms"] * 1e-3) / 1e9
        out["B_R_GBps"] = max(out["B_H_GBps"] - out["B_P_GBps"], 0.0)
        out["concurrent"] = concurrent_bandwidths(store, cpu_kernel, out["fill_ms"], concurrency_ms)
    tick(1.0)
    return out

