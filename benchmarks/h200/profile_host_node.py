"""What the one-graph step's CPU experts cost (engine/experts/graph_cpu.py): a host node's round trip
inside a CUDA graph, and one CPU expert called directly or from a host node.

    python3 benchmarks/h200/profile_host_node.py OUT.json

A store of 4 layers × 128 experts of Qwen3-30B-A3B's shape (bf16, pinned: 4.8 GB, more than the L3)
and a HostMoe over it, 15 threads (THREADS). Measured:

- direct: HostMoe.run for 1 token and 1 / 2 / 4 experts, a fresh expert each call, back to back and
  with 0.3 ms of busy waiting between calls (a layer's GPU work);
- graph: 16 "layers", each a GPU spin of GPU_US µs on the main stream and, on a side branch, the
  copies and host node of graph_cpu.GraphCpuSet.run, with no expert listed and with one fresh expert
  → ms per layer, against the same graph without the side branch.
"""

import json
import os
import sys
import time

import numpy as np
import torch

from engine.experts.graph_cpu import DTYPE_CODES, _launch_host_func
from engine.experts.store import ExpertStore
from engine.kernels import native

H, I, E, L, K = 2048, 768, 128, 4, 8
LAYERS_IN_GRAPH = 16


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    out_path = sys.argv[1]
    threads = int(os.environ.get("THREADS", 15))
    gpu_us = float(os.environ.get("GPU_US", 100))
    native.set_threads(threads)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = [torch.randn(E, 2 * I, H, generator=g, device=dev, dtype=torch.bfloat16) / H**0.5 for _ in range(L)]
    down = [torch.randn(E, H, I, generator=g, device=dev, dtype=torch.bfloat16) / I**0.5 for _ in range(L)]
    store = ExpertStore.from_layers(gate_up, down, dtype=torch.bfloat16, pin=True)
    del gate_up, down
    x_host = torch.randn(8, H, dtype=torch.bfloat16).pin_memory()
    pairs = torch.full((8 * K,), -1, dtype=torch.int64).pin_memory()
    weights = torch.full((8 * K,), 0.125, dtype=torch.float32).pin_memory()
    out_host = torch.zeros(8, H, dtype=torch.float32).pin_memory()
    table = np.ascontiguousarray(store.moe_table(slice(None), slice(None)))
    code = DTYPE_CODES[torch.bfloat16]
    host = native.module().HostMoe(x_host.data_ptr(), code, pairs.data_ptr(), weights.data_ptr(), out_host.data_ptr(),
                                   8, K, H, I, code, table.ctypes.data, L, E, threads)
    record = {"threads": threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "gpu_us": gpu_us,
              "isa": native.module().isa(), "direct": {}, "graph": {}}
    fresh = iter(range(10**9))

    def list_experts(n: int) -> int:
        """n fresh experts (cycling through all L·E) for token 0 → the layer they are in."""
        pairs.fill_(-1)
        first = next(fresh) * n
        layer = (first // E) % L
        for j in range(n):
            pairs[j] = (first + j) % E
        return layer

    # -- direct calls ---------------------------------------------------------------------------------
    for n in (0, 1, 2, 4):
        for gap in (0.0, 3e-4):
            times = []
            for _ in range(60):
                layer = list_experts(n)
                busy(gap)
                t0 = time.perf_counter()
                host.run(layer, 1)
                times.append(time.perf_counter() - t0)
            ms = float(np.median(times[10:])) * 1e3
            record["direct"][f"{n} experts, gap {gap * 1e3:.1f} ms"] = {
                "ms": round(ms, 4), "gbps": round(n * store.block_bytes / ms / 1e6, 1) if n else None}
            print("direct", n, gap, round(ms, 4), flush=True)
    host.take()

    # -- inside a graph -----------------------------------------------------------------------------
    launch = _launch_host_func()
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    out_dev = torch.zeros(1, H, device=dev, dtype=torch.float32)
    side = torch.cuda.Stream(dev)
    cycles = int(gpu_us * 1980)  # the H200's 1.98 GHz boost clock: GPU_US of spinning per layer

    def capture(with_node: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for layer in range(LAYERS_IN_GRAPH):
                main = torch.cuda.current_stream(dev)
                if with_node:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        x_host[:1].copy_(x, non_blocking=True)
                        status = launch(side.cuda_stream, type(host).entry_address, host.call_address(layer % L, 1))
                        assert status == 0, status
                        out_dev.copy_(out_host[:1], non_blocking=True)
                torch.cuda._sleep(cycles)
                if with_node:
                    main.wait_stream(side)
        torch.cuda.synchronize()
        return graph

    for name, with_node, n in (("no side branch", False, 0), ("host node, no expert", True, 0),
                               ("host node, 1 expert", True, 1), ("host node, 2 experts", True, 2)):
        graph = capture(with_node)
        times = []
        for _ in range(40):
            list_experts(n)  # the same expert ids in every layer of a replay: 16 layers read 4 store layers
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        ms = float(np.median(times[5:])) * 1e3 / LAYERS_IN_GRAPH
        stats = host.take()
        record["graph"][name] = {"ms_per_layer": round(ms, 4), "host_calls": stats["calls"],
                                 "host_compute_ms_per_call": round(1e3 * stats["compute_s"] / max(stats["calls"], 1), 4)}
        print("graph", name, record["graph"][name], flush=True)
    with open(out_path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
