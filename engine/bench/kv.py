"""`tandem bench kv`: decode-step attention per layer for each KV policy, no model weights needed.

For every (policy, batch size, context length) the KV is filled through the real append path (one
prefill step per sequence with random q/k/v of the chosen attention shape, routed to its final
regions at write time), then decode steps run `begin_step / attend × layers / end_step` with random
queries. `run` returns one JSON record (header, settings, `points`), each point a dict:

    policy, bs, L, layers, dtype, device, simulated
    decode_ms_per_layer        median over the timed steps of (step time / layers)
    kv_bytes_per_layer         bs · L · 2 · n_kv · hs · element size
    effective_gbps             kv_bytes_per_layer / decode time per layer
    h2d_gbps                   achieved rate of the ping-pong stream (hybrid policies)
    r_target, r_deployed, A_ns_per_token, B_ns_per_token   what the policy did
    prefill_route_ms / prefill_ideal_ms   one sequence's prefill with write-time routing (until every
                               write-back has landed) vs the same attention with the KV discarded
    prefill_route_warm_ms / prefill_ideal_warm_ms   the same for a sequence prefilled after one was
                               freed: host regions reused (no first-touch faults, no new pinning)
    bound_ms_per_layer         kv_bytes / (B_H2D + B_CPU): B_H2D a pinned copy measured here, B_CPU
                               the CPU kernel's rate in the cpu-centric run of the same point

`writescope` runs after `gpu-centric` and `cpu-centric` at each point and starts from the A and B
they measured (calibration on the spot); the comparison policies run as they are.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch

from engine.kernels.attention_gpu import attend_dense
from engine.kv.inplace import PartitionSpec
from engine.kv.monolithic import MonolithicKV
from engine.kv.resident import ResidentKV
from engine.kv.writescope import WriteScopeKV
from engine.sched.roofline import RooflineParams


@dataclass(frozen=True)
class AttentionShape:
    n_heads: int = 32
    n_kv_heads: int = 4
    head_dim: int = 128
    n_layers: int = 48


QWEN3_30B_A3B = AttentionShape()  # synthetic:qwen3-30b-a3b's attention
POLICIES = ("gpu-centric", "cpu-centric", "writescope", "monolithic", "resident")


def h2d_gbps(device: torch.device, nbytes: int = 256 << 20) -> float | None:
    """Pinned host → device copy rate, the B_H2D of the bound."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return 4 * nbytes / (time.perf_counter() - t0) / 1e9


def _sync(kv, device):
    if hasattr(kv, "synchronize"):
        kv.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def _make(policy, shape, bs, max_context, device, dtype, d_window, block_size, params, stream_graphs=True):
    kw = dict(max_context=max_context, max_batch=bs, device=device, dtype=dtype)
    if policy == "resident":
        return ResidentKV(shape.n_layers, shape.n_kv_heads, shape.head_dim, block_size=block_size, **kw)
    if policy == "monolithic":
        return MonolithicKV(shape.n_layers, shape.n_kv_heads, shape.head_dim, **kw)
    spec = PartitionSpec.for_shape(shape.n_kv_heads, shape.head_dim, dtype, cuda=device.type == "cuda",
                                   block_size=block_size, d_window=d_window, roofline=params)
    return WriteScopeKV(shape.n_layers, shape.n_kv_heads, shape.head_dim, spec=spec, policy=policy,
                        stream_graphs=stream_graphs, **kw)


def _prefill(kv, shape, L, device, dtype, gen) -> tuple[int, float, float]:
    """One sequence of L random tokens through the KV's prefill path; (seq id, route ms, ideal ms)."""
    q = torch.randn((1, shape.n_heads, L, shape.head_dim), device=device, dtype=dtype, generator=gen)
    k = torch.randn((1, shape.n_kv_heads, L, shape.head_dim), device=device, dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    scale = shape.head_dim ** -0.5
    _sync(kv, device)
    t0 = time.perf_counter()
    for _ in range(shape.n_layers):  # Ideal: the same attention, the KV dropped
        attend_dense(q, k, v, scale, causal=True)
    _sync(kv, device)
    ideal = time.perf_counter() - t0
    sid = kv.new_sequence()
    t0 = time.perf_counter()
    kv.begin_step([sid], L)
    for layer in range(shape.n_layers):  # Route: every layer's KV to its final region at write time
        kv.attend(layer, q, k, v)
    kv.end_step()
    _sync(kv, device)
    return sid, (time.perf_counter() - t0) * 1e3, ideal * 1e3


def bench_point(policy, shape, bs, L, *, device, dtype, d_window=256, block_size=64, steps=8, warmup=2,
                params: RooflineParams | None = None, seed=0, stream_graphs=True) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    kv = _make(policy, shape, bs, L + warmup + steps + 1, device, dtype, d_window, block_size, params, stream_graphs)
    try:
        fills = [_prefill(kv, shape, L, device, dtype, gen) for _ in range(bs)]
        sids = [f[0] for f in fills]
        q = torch.randn((bs, shape.n_heads, 1, shape.head_dim), device=device, dtype=dtype, generator=gen)
        k = torch.randn((bs, shape.n_kv_heads, 1, shape.head_dim), device=device, dtype=dtype, generator=gen)
        times, h2d0 = [], None
        for i in range(warmup + steps):
            _sync(kv, device)
            if i == warmup:
                h2d0 = _h2d_counters(kv)
            t0 = time.perf_counter()
            kv.begin_step(sids, 1)
            for layer in range(shape.n_layers):
                kv.attend(layer, q, k, k)
            kv.end_step()
            _sync(kv, device)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3 / shape.n_layers)
        h2d1 = _h2d_counters(kv)
        tel = kv.telemetry()
        # A new chat after one ended: its prefill routes into host regions already touched and
        # pinned, so this one costs the routing itself, not first-use page faults and pinning.
        kv.free(sids[0])
        pinned0 = _pinned_bytes(kv)
        warm = _prefill(kv, shape, L, device, dtype, gen)
        warm_new_pinned = _pinned_bytes(kv) - pinned0
    finally:
        if hasattr(kv, "close"):
            kv.close()
    token_bytes = 2 * shape.n_kv_heads * shape.head_dim * torch.empty((), dtype=dtype).element_size()
    kv_bytes = bs * L * token_bytes
    ms = statistics.median(times)
    streamed = (h2d1[0] - h2d0[0], h2d1[1] - h2d0[1]) if h2d0 and h2d1 else (0, 0.0)
    return {
        "policy": policy, "bs": bs, "L": L, "layers": shape.n_layers, "dtype": str(dtype).removeprefix("torch."),
        "device": str(device), "simulated": tel.get("simulated", False), "steps": steps,
        "decode_ms_per_layer": ms, "decode_ms_per_layer_all": times,
        "kv_bytes_per_layer": kv_bytes, "effective_gbps": kv_bytes / ms / 1e6,
        "h2d_gbps": streamed[0] / streamed[1] / 1e9 if streamed[1] > 0 else None,
        "r_target": tel.get("r_target"), "r_deployed": tel.get("r_deployed"),
        "A_ns_per_token": tel.get("A_ns_per_token"), "B_ns_per_token": tel.get("B_ns_per_token"),
        "delta_ms": tel.get("delta_ms"), "cpu_kernel": tel.get("cpu_kernel"),
        "prefill_route_ms": statistics.mean(f[1] for f in fills),
        "prefill_ideal_ms": statistics.mean(f[2] for f in fills),
        "prefill_route_warm_ms": warm[1], "prefill_ideal_warm_ms": warm[2],
        "prefill_warm_new_pinned_bytes": warm_new_pinned,
        "stream_graphs": tel.get("stream_graphs"),  # captures, replays, capture ms (CUDA decode)
    }


def _pinned_bytes(kv) -> int:
    """Page-locked host bytes the KV holds: its load region and its staging buffer."""
    held = kv.telemetry().get("bytes") or {}
    return (held.get("kv_pinned") or 0) + (held.get("kv_staging") or 0)


def _h2d_counters(kv) -> tuple[int, float] | None:
    if not hasattr(kv, "h2d_seconds"):
        return None
    return kv.h2d_timed_bytes, kv.h2d_seconds


def run(policies=POLICIES, batch_sizes=(1, 4, 16), lengths=(2048, 8192, 32768), *, shape=QWEN3_30B_A3B,
        device: str = "auto", dtype: str = "auto", d_window=256, block_size=64, steps=8, warmup=2,
        cpu_threads: int | None = None, stream_graphs: bool = True, progress=print) -> dict:
    """The whole grid → one JSON record: header (date, command, machine), settings, `points` (one
    dict per policy, bs and L). writescope at each point starts from the A and B that r=0 and r=1
    measured there."""
    from engine.bench.common import header

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    dt = {"auto": torch.bfloat16 if dev.type == "cuda" else torch.float32,
          "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    from engine.kernels import native

    if cpu_threads is None and dev.type == "cuda":  # as the engine does: a core of its own for the GPU thread
        cpu_threads = max(1, native.available_cores() - 1)
    if cpu_threads:
        torch.set_num_threads(cpu_threads)
        native.set_threads(cpu_threads)
    b_h2d = h2d_gbps(dev)
    points = []
    order = [p for p in ("gpu-centric", "cpu-centric") if p in policies] + \
            [p for p in policies if p not in ("gpu-centric", "cpu-centric")]
    for L in lengths:
        for bs in batch_sizes:
            at = {}
            for policy in order:
                params = None
                if policy == "writescope" and "decode_ms_per_layer" in at.get("gpu-centric", {}) \
                        and "decode_ms_per_layer" in at.get("cpu-centric", {}):
                    tokens = bs * L
                    params = RooflineParams(A_ns_per_token=at["cpu-centric"]["decode_ms_per_layer"] * 1e6 / tokens,
                                            B_ns_per_token=at["gpu-centric"]["decode_ms_per_layer"] * 1e6 / tokens,
                                            delta_ms=0.0)
                try:
                    rec = bench_point(policy, shape, bs, L, device=dev, dtype=dt, d_window=d_window,
                                      block_size=block_size, steps=steps, warmup=warmup, params=params,
                                      stream_graphs=stream_graphs)
                except Exception as e:  # e.g. resident KV that does not fit: record it and go on
                    rec = {"policy": policy, "bs": bs, "L": L, "error": f"{type(e).__name__}: {e}"}
                at[policy] = rec
                if "error" not in rec:
                    cpu = at.get("cpu-centric", {}).get("effective_gbps")
                    rec["b_h2d_gbps"], rec["b_cpu_gbps"] = b_h2d, cpu
                    if b_h2d and cpu:
                        rec["bound_ms_per_layer"] = rec["kv_bytes_per_layer"] / ((b_h2d + cpu) * 1e9) * 1e3
                points.append(rec)
                if progress:
                    progress(_line(rec))
    return {"bench": "kv", **header(), "shape": vars(shape), "dtype": str(dt).removeprefix("torch."),
            "device": str(dev), "d_window": d_window, "block_size": block_size, "steps": steps, "warmup": warmup,
            "cpu_threads": torch.get_num_threads(), "stream_graphs": stream_graphs,
            "b_h2d_gbps": b_h2d, "points": points}


def _line(rec: dict) -> str:
    if "error" in rec:
        return f"{rec['policy']:>12} bs={rec['bs']:<3} L={rec['L']:<6} error: {rec['error']}"
    extra = f" h2d {rec['h2d_gbps']:.1f} GB/s" if rec.get("h2d_gbps") else ""
    r = f" r={rec['r_deployed']:.2f}" if rec.get("r_deployed") is not None else ""
    return (f"{rec['policy']:>12} bs={rec['bs']:<3} L={rec['L']:<6} {rec['decode_ms_per_layer']:8.3f} ms/layer "
            f"({rec['effective_gbps']:.1f} GB/s){r}{extra}")


def add_arguments(p) -> None:
    """The flags of `python -m engine.bench.kv` (the names `from_args` reads)."""
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated KV policies")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--lengths", default="2048,8192,32768", help="context lengths L")
    p.add_argument("--layers", type=int, default=QWEN3_30B_A3B.n_layers)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    p.add_argument("--d-window", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cpu-threads", type=int, default=None, help="default: all cores but one with CUDA")
    p.add_argument("--no-stream-graphs", action="store_true",
                   help="stream the pinned share eagerly every step instead of replaying a CUDA graph per layer")
    p.add_argument("--json", default=None, help="also write the record here")


def from_args(args) -> dict:
    shape = AttentionShape(QWEN3_30B_A3B.n_heads, QWEN3_30B_A3B.n_kv_heads, QWEN3_30B_A3B.head_dim, args.layers)
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # stdout carries the JSON
    return run([p for p in args.policies.split(",") if p], [int(x) for x in args.batch_sizes.split(",")],
               [int(x) for x in args.lengths.split(",")], shape=shape, device=args.device, dtype=args.dtype,
               d_window=args.d_window, block_size=args.block_size, steps=args.steps, warmup=args.warmup,
               cpu_threads=args.cpu_threads, stream_graphs=not args.no_stream_graphs, progress=progress)


if __name__ == "__main__":
    import argparse

    from engine.bench.common import write_json

    parser = argparse.ArgumentParser(prog="python -m engine.bench.kv", description=__doc__.split("\n")[0])
    add_arguments(parser)
    ns = parser.parse_args()
    write_json(from_args(ns), ns.json)
