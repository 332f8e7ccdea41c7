"""Where a hybrid KV decode step spends its time, layer by layer (the `tandem bench kv` harness, timed).

    python3 benchmarks/h200/profile_kv.py OUT_DIR [policies] [batch sizes] [L]

For each policy and batch size: the KV of `synthetic:qwen3-30b-a3b`'s attention shape (8 layers) is
filled through the real prefill path, then 12 decode steps run as `tandem bench kv` runs them, with
host timestamps around each part of `WriteScopeKV.attend` (both threads): the main thread up to the
CPU part's start, the wait for the query on the host, the block table, the kernel (which writes the
page-locked result buffer), the hand-back, and the merge. Then, on the same views, the CPU kernel alone (main thread
and the worker thread), and the kernel beside a 256 MiB pinned H2D copy loop (each side's rate
alone and together: how much the CPU share and the DMA take from each other's DRAM reads).
Writes OUT_DIR/profile-kv.json and prints a table.
"""

import cProfile
import io
import json
import os
import pstats
import statistics
import traceback
import warnings
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from engine.bench import kv as kvbench
from engine.kernels import native
from engine.kv import writescope as ws

STAMPS: list = []  # (tag, thread id, perf_counter)


def stamp(tag: str) -> None:
    STAMPS.append((tag, threading.get_ident(), time.perf_counter()))


def wrap(owner, name: str, before: str, after: str | None = None):
    fn = getattr(owner, name)

    def wrapped(*a, **k):
        stamp(before)
        try:
            return fn(*a, **k)
        finally:
            if after:
                stamp(after)

    setattr(owner, name, wrapped)


class _Ready:
    def __init__(self, ev):
        self.ev = ev

    def synchronize(self):
        self.ev.synchronize()
        stamp("ready")


def instrument() -> None:
    wrap(ws.WriteScopeKV, "attend", "attend0", "attend1")
    wrap(ws.WriteScopeKV, "_cpu_part", "cpu0", "cpu1")
    wrap(ws, "attend_blocks", "k0", "k1")
    wrap(ws.HostExchange, "result_buffers", "s0", "s1")
    wrap(ws.HostExchange, "to_device", "td", None)
    wrap(ws.WriteScopeKV, "_merge", "m0", "m1")
    wrap(ws.WriteScopeKV, "begin_step", "b0", "b1")
    wrap(ws.WriteScopeKV, "end_step", "e0", "e1")
    wrap(ws.InplaceKVCache, "flush", "f0", "f1")
    to_host = ws.HostExchange.to_host

    def to_host_stamped(self, q, dtype, *rest):
        host, ev = to_host(self, q, dtype, *rest)
        stamp("submit")
        return host, _Ready(ev)

    ws.HostExchange.to_host = to_host_stamped


def layer_breakdown(stamps: list) -> dict:
    """Per attend call: the spans between stamps (µs), medians over calls."""
    spans = defaultdict(list)
    cur: dict = {}
    last_end = None
    for tag, _, t in stamps:
        if tag == "attend0":
            if last_end is not None:
                spans["gap_between_layers"].append(t - last_end)
            cur = {"attend0": t}
        elif tag == "b0":
            last_end = None
        else:
            cur[tag] = t
        if tag == "attend1":
            c = cur
            spans["attend_total"].append(c["attend1"] - c["attend0"])
            if "cpu0" in c:
                spans["main_to_submit"].append(c["submit"] - c["attend0"])
                spans["worker_pickup"].append(c["cpu0"] - c["submit"])
                spans["wait_query_on_host"].append(c["ready"] - c["cpu0"])
                spans["views_and_probe"].append(c["k0"] - c["ready"] - (c["s1"] - c["s0"]))
                spans["kernel_call"].append(c["k1"] - c["k0"])
                spans["result_buffer_wait"].append(c["s1"] - c["s0"])
                spans["result_to_main"].append(c["td"] - c["cpu1"])
                spans["main_after_result"].append(c["attend1"] - c["td"])
                spans["main_launches_after_submit"].append(c["f1"] - c["submit"])
                spans["main_waits_for_cpu"].append(c["td"] - c["f1"])
            last_end = t
    return {k: round(statistics.median(v) * 1e6, 1) for k, v in spans.items() if v}


def kernel_alone(kv, sids, q_host, reps: int = 10) -> dict:
    """The CPU kernel over layer 0's CPU views, alone: main thread, then the worker thread (ms)."""
    kv.begin_step(sids, 1)
    views = kv.cache.cpu_views(0, kv.plan)
    scale = q_host.shape[-1] ** -0.5
    res = {}

    def loop():
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            ws.attend_blocks(q_host, views, scale=scale)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    if views and any(len(v) for v in views):
        res["main_ms"] = loop()
        res["worker_ms"] = kv.worker.submit(loop).result()
        res["bytes"] = sum(k.numel() * k.element_size() * 2 for row in views for k, _ in row)
        res["views"] = sum(len(row) for row in views)
    if views and any(len(v) for v in views) and torch.cuda.is_available():  # beside a pinned H2D copy loop
        src = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
        dst = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            e0.record()
            for _ in range(4):
                dst.copy_(src, non_blocking=True)
            e1.record()
        e1.synchronize()
        res["dma_alone_gbps"] = 4 * src.numel() / (e0.elapsed_time(e1) / 1e3) / 1e9
        with torch.cuda.stream(stream):
            e0.record()
            for _ in range(4):
                dst.copy_(src, non_blocking=True)
            e1.record()
        beside = kv.worker.submit(loop).result()
        e1.synchronize()
        res["dma_beside_kernel_gbps"] = 4 * src.numel() / (e0.elapsed_time(e1) / 1e3) / 1e9
        res["worker_ms_beside_dma"] = beside
    for layer in range(kv.cache.n_layers):
        zq = torch.zeros((len(sids), 32, 1, 128), device=kv.device, dtype=kv.dtype)
        zk = torch.zeros((len(sids), 4, 1, 128), device=kv.device, dtype=kv.dtype)
        kv.attend(layer, zq, zk, zk)
    kv.end_step()
    kv.synchronize()
    return res


def diagnose(kv, sids, q, k, n_layers: int) -> tuple[dict, str]:
    """Which calls of a step block the host on the device (CUDA sync debug mode: where, how often),
    and a cProfile of the driving thread over 3 steps (by own time)."""
    def step():
        kv.begin_step(sids, 1)
        for layer in range(n_layers):
            kv.attend(layer, q, k, k)
        kv.end_step()

    syncs: dict = {}

    def note(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/engine/" in f.filename]
        key = " < ".join(f"{f.filename.split('/engine/')[-1]}:{f.lineno}" for f in reversed(frames[-3:]))
        key += " | " + str(message)[:60]
        syncs[key] = syncs.get(key, 0) + 1

    if torch.cuda.is_available():
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            torch.cuda.set_sync_debug_mode(1)
            try:
                for _ in range(2):
                    step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        kv.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        step()
    prof.disable()
    kv.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return syncs, text.getvalue()


def main() -> None:
    if os.environ.get("SWITCH_INTERVAL"):  # an experiment: the GIL handed over sooner between the two threads
        sys.setswitchinterval(float(os.environ["SWITCH_INTERVAL"]))
    out = Path(sys.argv[1])
    policies = sys.argv[2].split(",") if len(sys.argv) > 2 else ["cpu-centric", "gpu-centric", "fixed:0.45"]
    batches = [int(b) for b in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 4]
    L = int(sys.argv[4]) if len(sys.argv) > 4 else 32768
    out.mkdir(parents=True, exist_ok=True)
    threads = max(1, native.available_cores() - 1)
    torch.set_num_threads(threads)
    native.set_threads(threads)
    instrument()
    shape = kvbench.AttentionShape(n_layers=8)
    dev, dt = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16  # cpu: a dry run
    record = {"L": L, "threads": threads, "runs": []}
    for policy in policies:
        for bs in batches:
            gen = torch.Generator(device=dev).manual_seed(0)
            kv = kvbench._make(policy, shape, bs, L + 64, dev, dt, 256, 64, None)
            try:
                sids = [kvbench._prefill(kv, shape, L, dev, dt, gen)[0] for _ in range(bs)]
                q = torch.randn((bs, 32, 1, 128), device=dev, dtype=dt, generator=gen)
                k = torch.randn((bs, 4, 1, 128), device=dev, dtype=dt, generator=gen)
                times = []
                for i in range(14):
                    kv.synchronize()
                    if i == 4:
                        STAMPS.clear()
                    t0 = time.perf_counter()
                    kv.begin_step(sids, 1)
                    for layer in range(shape.n_layers):
                        kv.attend(layer, q, k, k)
                    kv.end_step()
                    kv.synchronize()
                    if i >= 4:
                        times.append((time.perf_counter() - t0) * 1e3 / shape.n_layers)
                stamps = list(STAMPS)
                tel = kv.telemetry()
                run = {"policy": policy, "bs": bs, "ms_per_layer": round(statistics.median(times), 3),
                       "r_deployed": tel["r_deployed"], "A_ns_per_token": tel["A_ns_per_token"],
                       "B_ns_per_token": tel["B_ns_per_token"], "h2d_gbps": tel["pcie"]["h2d_gbps"],
                       "us": layer_breakdown(stamps)}
                run["host_syncs"], run["profile"] = diagnose(kv, sids, q, k, shape.n_layers)
                run["kernel_alone"] = kernel_alone(kv, sids, q.cpu())
            finally:
                kv.close()
            record["runs"].append(run)
            print(json.dumps(run), flush=True)
    (out / "profile-kv.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
