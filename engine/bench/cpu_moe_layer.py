"""`tandem bench cpu-kernels`' MoE layer section (issue #5): the CPU side of one MoE layer,
`layer_experts` experts (default 8) each applied to the same n tokens, as the offload path computed
it (one `expert_ffn` call per expert plus a gather, a weight multiply and an index_add_ per expert)
vs one `experts_cpu.moe_ffn` call; run in a ThreadPoolExecutor worker (as the engine does) with the
main thread idle in `result()` or running small torch ops, and from the main thread alone (the
tight-loop figure). ms per layer, weight GB/s; every figure the median of `repeats` timed calls
after a warm-up.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from engine.hw.timing import time_cpu
from engine.kernels import experts_cpu, native


def _pairs_by_expert(ids: np.ndarray, experts: list) -> list[np.ndarray]:
    """Per expert of `experts`, its (token, choice) pairs' flat indices into ids (N, k), in order."""
    flat = ids.ravel()
    order = np.argsort(flat, kind="stable")
    sorted_ids = flat[order]
    lo, hi = np.searchsorted(sorted_ids, experts, side="left"), np.searchsorted(sorted_ids, experts, side="right")
    return [order[a:b] for a, b in zip(lo.tolist(), hi.tolist())]


def _per_expert_layer(x: torch.Tensor, ids: np.ndarray, w: torch.Tensor, experts: list, views, threads: int):
    """The layer as offload's per-expert loop computes it: pairs grouped by expert, then per expert a
    gather of its rows, expert_ffn, the weight multiply and an index_add_ into out (N, H)."""
    with torch.inference_mode():
        k = ids.shape[1]
        w_flat = w.reshape(-1)
        out = torch.zeros_like(x)
        for e, expert_pairs in zip(experts, _pairs_by_expert(ids, experts)):
            pairs = torch.from_numpy(expert_pairs)
            tok = pairs // k
            out.index_add_(0, tok, experts_cpu.expert_ffn(x[tok], *views(e), threads=threads)
                           * w_flat[pairs].unsqueeze(1))
        return out


def _moe_layer(x: torch.Tensor, ids: np.ndarray, w: torch.Tensor, experts: list, views, threads: int):
    """The same layer through one moe_ffn call (its pair lists built from the same routing)."""
    k = ids.shape[1]
    w_flat = w.reshape(-1).float().numpy()
    pairs = _pairs_by_expert(ids, experts)
    return experts_cpu.moe_ffn(x, [views(e) for e in experts], [p // k for p in pairs], [w_flat[p] for p in pairs],
                               threads=threads)


def moe_layer(tokens: list[int], threads: list[int], repeats: int, *, hidden: int, ffn: int, layer_experts: int,
              cycled: int, progress: Callable[[str], None]) -> dict:
    from engine.hw.expert_costs import ExpertStore
    from engine.hw.shapes import ExpertShape

    shape = ExpertShape(hidden=hidden, ffn=ffn, dtype="bfloat16")
    store = ExpertStore(shape, max(cycled, 2 * layer_experts))
    count = len(store.flat)
    layer_bytes = layer_experts * shape.bytes_per_expert
    main_busy = (torch.randn(4, 256), torch.randn(256, 64))  # the main thread's small torch ops

    def busy_wait(fut):
        a, b = main_busy
        while not fut.done():
            (a @ b).add_(1.0).sum()
        return fut.result()

    rows = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-cpu-experts") as pool:
        for t in threads:
            torch.set_num_threads(t)
            for n in tokens:
                # Every token picks the same layer_experts experts (top-k = layer_experts): n tokens each.
                x = torch.empty(n, hidden, dtype=torch.bfloat16).uniform_(-1, 1)  # (n, H)
                ids = np.tile(np.arange(layer_experts), (n, 1))  # (n, k) local expert ids
                w = torch.rand(n, layer_experts).bfloat16()  # (n, k) routing weights, in the model's dtype
                row = {"tokens_per_expert": n, "threads": t, "layer_experts": layer_experts,
                       "layer_bytes": layer_bytes, "experts_cycled": count}
                for name, layer in (("per_expert", _per_expert_layer), ("moe_ffn", _moe_layer)):
                    # Call i reads experts 8i … 8i + 7 (mod the store): weights come from DRAM.
                    views = lambda e, i: store.views((i * layer_experts + e) % count)  # noqa: E731
                    call = lambda i: layer(x, ids, w, list(range(layer_experts)), lambda e: views(e, i), t)  # noqa: E731
                    progress(f"moe layer {name} tokens={n} threads={t}")
                    main = time_cpu(call, 2, repeats).median_ms
                    idle = time_cpu(lambda i: pool.submit(call, i).result(), 2, repeats).median_ms
                    busy = time_cpu(lambda i: busy_wait(pool.submit(call, i)), 2, repeats).median_ms
                    row[name] = {"main_thread_ms": round(main, 4), "worker_ms": round(idle, 4),
                                 "worker_busy_main_ms": round(busy, 4),
                                 "worker_busy_main_GBps": round(layer_bytes / busy / 1e6, 2)}  # bytes/ms → GB/s
                row["speedup_worker_busy_main"] = round(row["per_expert"]["worker_busy_main_ms"]
                                                        / row["moe_ffn"]["worker_busy_main_ms"], 3)
                rows.append(row)
    # How OpenMP threads wait decides what a fork costs from a second thread (see native.openmp_runtimes).
    env = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    return {"hidden": hidden, "ffn": ffn, "dtype": "bfloat16", "kernel": experts_cpu.implementation(1),
            "openmp_runtimes_mapped": native.openmp_runtimes(), "openmp_runtime_used": native.openmp_runtime(),
            "openmp_env": env,
            "points": rows}
