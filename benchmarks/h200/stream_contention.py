"""Does the streaming side of a split step slow down while the CPU side runs, and why? (#39)

The aggregate of 2026-12-08 (h200/2026-12-08-aggregate-probe-h100/) measured WriteScope's streaming
side at 35-38 ns a KV token alone and 48-64 beside the CPU side: DeepSeek-V2-Lite's MLA kernel halved
it, fewer CPU threads gave it back. This separates the candidates, for one model's KV format:

  GPU loops (LOADS ping-pong loads of one extent-layer each, CUDA events)
    copy    the H2D copies alone: the DMA's own rate
    eager   copy + the backend's device attention per load, issued from this thread one call at a time
    graph   the same loads captured once as a CUDA graph and replayed: nothing issued in the loop
  CPU loads (a background thread, for the whole measurement)
    none    nothing
    kernel  the backend's own CPU kernel (WriteScopeKV.attend_cpu: MLA or per-head) over 4 rows × 32K
    read    the native STREAM read of 1 GiB: host memory traffic without the kernel's arithmetic

each CPU load at each thread count. copy slowed → the DMA shares something with the host's reads;
eager slowed while graph is not → the issuing thread loses its core or clock; all slowed alike → neither.

    python3 benchmarks/h200/stream_contention.py deepseek 15,8,4 > RES/contention.jsonl
(MODEL: deepseek or qwen3; THREADS: comma-separated; `--device cpu` runs the host parts for a check.)
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from engine.hw.timing import time_cpu, time_cuda
from engine.kernels import native
from engine.kv.inplace import PartitionSpec
from engine.kv.latent import LatentWriteScopeKV
from engine.kv.writescope import WriteScopeKV

# (query heads, KV format) of each model's attention: DeepSeek-V2-Lite's latent rows (r 512 + dr 64)
# in two planes of 288, Qwen3-30B-A3B's 4 KV heads of 128.
MODELS = {"deepseek": (16, "latent"), "qwen3": (32, "heads")}
LOADS = 64  # ping-pong loads a measurement: ~1 GB at 16 MiB a load, ~20-30 ms at PCIe Gen5
REPEATS = 5
CPU_ROWS, CPU_ROW_TOKENS = 4, 32768  # the CPU load's working set: 4 × 32K tokens, far past the LLC
WARM_S = 0.05  # the CPU load runs this long before the GPU loop is timed


def backend(model: str, device: torch.device):
    n_heads, form = MODELS[model]
    kw = dict(max_context=32768, max_batch=CPU_ROWS, device=device, dtype=torch.bfloat16)
    cuda = device.type == "cuda"
    if form == "latent":
        spec = PartitionSpec.for_shape(1, 288, torch.bfloat16, cuda=cuda, max_context=32768)
        return n_heads, LatentWriteScopeKV(1, 576, 512, spec=spec, **kw)
    spec = PartitionSpec.for_shape(4, 128, torch.bfloat16, cuda=cuda, max_context=32768)
    return n_heads, WriteScopeKV(1, 4, 128, spec=spec, **kw)


def cpu_load(kind: str, kv, n_heads: int):
    """A function that runs one unit of the CPU load, and the bytes it reads."""
    if kind == "read":
        src = torch.ones(1 << 30, dtype=torch.uint8)
        return lambda: native.module().stream_read(src.data_ptr(), src.numel(), native.threads()), src.numel()
    cache = kv.cache
    arenas = [torch.full((2, cache.n_kv, CPU_ROW_TOKENS, cache.head_dim), 0.01, dtype=kv.dtype) for _ in range(CPU_ROWS)]
    blocks = kv.prepare_cpu([[(a[0], a[1])] for a in arenas], n_heads)
    q = torch.full((CPU_ROWS, n_heads, 1, kv.query_width), 0.01, dtype=kv.dtype)
    scale = cache.head_dim ** -0.5
    nbytes = sum(a.numel() * a.element_size() for a in arenas)
    return (lambda: kv.attend_cpu(q, blocks, scale)), nbytes


class Background:
    """Runs `unit` in a loop on its own thread until stopped; the GB/s it kept up."""

    def __init__(self, unit, nbytes: int):
        self.unit, self.nbytes, self.stop, self.units = unit, nbytes, threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        t0 = time.perf_counter()
        while not self.stop.is_set():
            self.unit()
            self.units += 1
        self.gbps = self.units * self.nbytes / (time.perf_counter() - t0) / 1e9

    def __enter__(self):
        self.thread.start()
        time.sleep(WARM_S)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def gpu_loops(kv, n_heads: int) -> dict:
    """name → a function that runs LOADS loads."""
    cuda = kv.transport.cuda
    bufs = kv.cache.pingpong  # (2, G·E, 2, n_kv, hs)
    src = kv.transport.host(tuple(bufs[0].shape), kv.dtype, pinned=True)
    src.tensor.fill_(0.01)
    q = torch.full((1, n_heads, 1, kv.query_width), 0.01, dtype=kv.dtype, device=kv.device)
    scale = kv.cache.head_dim ** -0.5

    def copy():
        for i in range(LOADS):
            bufs[i % 2].copy_(src.tensor, non_blocking=True)

    def eager():
        for i in range(LOADS):
            bufs[i % 2].copy_(src.tensor, non_blocking=True)
            k, v = kv.pingpong_views(i % 2)
            kv.device_part(q, k, v, scale, fp32=not cuda)

    loops = {"copy": copy, "eager": eager}
    if cuda:
        eager()  # warm the kernels before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        loops["graph"] = graph.replay
    loops["_keep"] = src  # the pinned source lives as long as the loops
    return loops


def time_loop(fn, cuda: bool) -> float:
    """Median ms of REPEATS runs after one warm-up."""
    return (time_cuda if cuda else time_cpu)(lambda i: fn(), 1, REPEATS).median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("threads", help="comma-separated thread counts of the CPU load")
    ap.add_argument("--device", default="cuda")
    ns = ap.parse_args()
    device = torch.device(ns.device)
    cuda = device.type == "cuda"
    n_heads, kv = backend(ns.model, device)
    loops = gpu_loops(kv, n_heads)
    load_bytes = LOADS * kv.cache.pingpong[0].numel() * kv.cache.pingpong[0].element_size()
    try:
        for name, fn in loops.items():
            if name.startswith("_"):
                continue
            ms = time_loop(fn, cuda)
            print(json.dumps({"model": ns.model, "loop": name, "cpu": "none", "threads": 0, "ms": round(ms, 3),
                              "gpu_GBps": round(load_bytes / ms / 1e6, 2)}), flush=True)
            for kind in ("kernel", "read"):
                for t in (int(x) for x in ns.threads.split(",")):
                    native.set_threads(t)
                    unit, nbytes = cpu_load(kind, kv, n_heads)
                    with Background(unit, nbytes) as bg:
                        ms = time_loop(fn, cuda)
                    print(json.dumps({"model": ns.model, "loop": name, "cpu": kind, "threads": t, "ms": round(ms, 3),
                                      "gpu_GBps": round(load_bytes / ms / 1e6, 2), "cpu_GBps": round(bg.gbps, 2)}),
                          flush=True)
    finally:
        native.set_threads(None)
        loops["_keep"].release()
        kv.close()


if __name__ == "__main__":
    main()
