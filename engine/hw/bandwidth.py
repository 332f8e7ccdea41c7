"""Memory and link bandwidths: DRAM (STREAM-style, torch on host tensors), H2D/D2H over transfer
sizes from pinned, pageable and strided host memory, and the cost of pinning.

Units: bytes and GB/s with GB = 10^9 bytes (as PCIe and DRAM are quoted); ms per MB with MB = 10^6.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from engine.hw.hostmem import register, registered, touched, unregister
from engine.hw.probe import mark_unavailable
from engine.hw.timing import GPU, fit_line, time_cpu, time_cuda

KiB, MiB = 2**10, 2**20
# Strided transfers: 32 KiB of valid data in every 256 KiB of source (one head's rows in a
# per-layer, all-heads layout): the pattern a non-contiguous KV view produces.
STRIDED_ROW_BYTES = 32 * KiB
STRIDED_ROW_STRIDE = 256 * KiB


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("inf")


def dram_bandwidth(nbytes: int, warmup: int, repeats: int) -> dict:
    """Read (a sum over the array) and copy (read + write counted) bandwidth of host memory."""
    a = touched(nbytes, torch.float32)  # (n,) far larger than the last-level cache
    b = touched(nbytes, torch.float32)
    read = time_cpu(lambda i: a.sum(), warmup, repeats)
    copy = time_cpu(lambda i: b.copy_(a), warmup, repeats)
    return {"read_GBps": _gbps(nbytes, read.median_ms), "copy_GBps": _gbps(2 * nbytes, copy.median_ms),
            "array_bytes": nbytes, "threads": torch.get_num_threads(),
            "read": read.to_dict(), "copy": copy.to_dict(),
            "method": "torch on float32 host tensors: read = sum(a), copy = b.copy_(a) counting read and write"}


def transfer_curves(sizes: list[int], warmup: int, repeats: int,
                    tick: Callable[[float], None] = lambda f: None) -> dict:
    """H2D and D2H GB/s by transfer size for pinned (cudaHostRegister), pageable and strided host
    memory, one copy_ per transfer, timed by CUDA events on a side stream."""
    dev = torch.device(GPU)
    largest = max(sizes)
    stream = torch.cuda.Stream()
    gpu = torch.empty(largest, dtype=torch.uint8, device=dev)
    pageable = touched(largest)
    pinned = touched(largest)
    strided = touched(largest // STRIDED_ROW_BYTES * STRIDED_ROW_STRIDE)  # 8× the largest transfer
    out = {d: {"pinned": [], "pageable": [], "strided": []} for d in ("h2d", "d2h")}
    with registered(pinned), registered(strided):
        for n, size in enumerate(sizes):
            rows = max(size // STRIDED_ROW_BYTES, 1)
            host_rows = strided[: rows * STRIDED_ROW_STRIDE].view(rows, STRIDED_ROW_STRIDE)[:, :STRIDED_ROW_BYTES]
            dev_rows = gpu[: rows * STRIDED_ROW_BYTES].view(rows, STRIDED_ROW_BYTES)
            cases = {
                ("h2d", "pinned"): (lambda i, s=size: gpu[:s].copy_(pinned[:s], non_blocking=True), size),
                ("h2d", "pageable"): (lambda i, s=size: gpu[:s].copy_(pageable[:s], non_blocking=True), size),
                ("h2d", "strided"): (lambda i: dev_rows.copy_(host_rows, non_blocking=True), rows * STRIDED_ROW_BYTES),
                ("d2h", "pinned"): (lambda i, s=size: pinned[:s].copy_(gpu[:s], non_blocking=True), size),
                ("d2h", "pageable"): (lambda i, s=size: pageable[:s].copy_(gpu[:s], non_blocking=True), size),
                ("d2h", "strided"): (lambda i: host_rows.copy_(dev_rows, non_blocking=True), rows * STRIDED_ROW_BYTES),
            }
            for (direction, kind), (fn, nbytes) in cases.items():
                t = time_cuda(fn, warmup, repeats, stream)
                out[direction][kind].append({"bytes": nbytes, "ms": t.median_ms, "GBps": _gbps(nbytes, t.median_ms)})
            tick((n + 1) / len(sizes))
    for direction in ("h2d", "d2h"):
        pts = out[direction]["pinned"]
        if len(pts) >= 2:  # t = latency + bytes / peak, fitted over the pinned curve
            slope, intercept = fit_line([p["bytes"] for p in pts], [p["ms"] for p in pts])
            fit = {"latency_us": max(intercept, 0.0) * 1e3}
            if slope > 0:
                fit["GBps"] = 1.0 / (slope * 1e-3) / 1e9
            else:
                mark_unavailable(fit, "GBps", "transfer time did not grow with size (too few or noisy points)")
            out[direction]["pinned_fit"] = fit
    out["method"] = ("one copy_ per transfer on a side stream, CUDA events; pinned = ordinary memory under "
                     "cudaHostRegister; strided = 32 KiB valid in every 256 KiB of pinned memory, one copy_ of the view")
    return out


def pin_cost(nbytes: int, repeats: int) -> dict:
    """ms per MB to page-lock memory: registering ordinary (touched) memory, and allocating through
    torch's pinned allocator (its cache emptied first, so each sample pins afresh)."""
    mb = nbytes / 1e6
    samples = []
    for _ in range(repeats):
        t = touched(nbytes)  # fresh, committed pages: the registration is all that is timed
        t0 = time.perf_counter()
        register(t)
        samples.append((time.perf_counter() - t0) * 1e3)
        unregister(t)
    empty_cache = getattr(torch._C, "_host_emptyCache", lambda: None)
    allocs = []
    for _ in range(repeats):
        empty_cache()  # the previous block is freed outside the timed region
        t0 = time.perf_counter()
        block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        allocs.append((time.perf_counter() - t0) * 1e3)
        del block
    empty_cache()
    return {"bytes": nbytes, "register_ms_per_MB": statistics.median(samples) / mb,
            "pin_alloc_ms_per_MB": statistics.median(allocs) / mb,
            "method": "cudaHostRegister of touched ordinary memory; torch.empty(pin_memory=True) with the host cache emptied"}
