"""Where a decode step's time goes on the GPU, per policy: kernels, copies and the idle gaps between them.

    python3 benchmarks/h200/profile_step_timeline.py OUT.json [model] [policies] [context] [bs]

Loads the model as `tandem bench experts` does (24 GB VRAM budget, 15 CPU threads), prefills one
random prompt of `context` tokens (default 2048) per sequence, and for each policy (default
adaptive,on-demand) decodes 24 warm-up tokens (graph capture, compiles, the decode form's choice, a warm
cache), then 8 tokens under torch.profiler with CUDA activity. Per policy it writes the wall time a
step, the GPU's busy time a step (the union of kernel and copy intervals), the idle time that leaves,
split by gap length (under 5 µs: a graph's kernel-to-kernel launch; 5–50 µs; over 50 µs: the GPU waited
for the host, e.g. between replays), and the kernels and copies by total time a step. Kernels inside
CUDA graph replays are recorded too.
"""

import cProfile
import json
import pstats
import sys
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from engine.api import Engine, EngineConfig, GenerationRequest
from engine.bench.experts import WARM_TOKENS, context_needed

WARM, TIMED = WARM_TOKENS + 2, 8
GAP_BUCKETS_US = (5.0, 50.0)  # idle gaps shorter than the first, up to the second, longer


def decode(engine, history: list[list[int]], sessions: list[str], n: int) -> float:
    reqs = [GenerationRequest(prompt_ids=h, max_new_tokens=n, temperature=1.0, seed=i, ignore_eos=True,
                              session_id=s) for i, (h, s) in enumerate(zip(history, sessions))]
    t0 = time.perf_counter()
    for h, r in zip(history, engine.generate_batch(reqs)):
        h.extend(r.token_ids)
    return time.perf_counter() - t0


def device_intervals(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every kernel and copy the profiler saw on the GPU."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, e.time_range.start, e.time_range.end))
    return sorted(out, key=lambda x: x[1])


def summarise(intervals, steps: int, wall_s: float) -> dict:
    busy, end = 0.0, None
    gaps = [[0, 0.0] for _ in range(len(GAP_BUCKETS_US) + 1)]  # per bucket: (count, µs)
    long_gaps: dict[str, list[float]] = {}  # "kernel before → kernel after" → the long gaps' µs
    last = None
    for name, s, e in intervals:  # union of the intervals, and the idle gaps between its pieces
        if end is None or s >= end:
            if end is not None:
                bucket = sum(s - end >= b for b in GAP_BUCKETS_US)
                gaps[bucket][0] += 1
                gaps[bucket][1] += s - end
                if bucket == len(GAP_BUCKETS_US):
                    long_gaps.setdefault(f"{last[:60]} → {name[:60]}", []).append(s - end)
            busy += e - s
            end, last = e, name
        elif e > end:
            busy += e - end
            end, last = e, name
    by_name: dict[str, list[float]] = {}
    for name, s, e in intervals:
        by_name.setdefault(name, []).append(e - s)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    span = (intervals[-1][2] - intervals[0][1]) if intervals else 0.0
    return {"steps": steps, "wall_ms_per_step": round(wall_s * 1e3 / steps, 3),
            "gpu_busy_ms_per_step": round(busy / 1e3 / steps, 3),
            "gpu_span_ms_per_step": round(span / 1e3 / steps, 3),
            "gpu_idle_share_of_wall": round(1 - busy / 1e3 / (wall_s * 1e3), 3) if wall_s else None,
            "kernels_and_copies_per_step": round(len(intervals) / steps, 1),
            "idle_gaps_per_step": {name: {"count": round(n / steps, 1), "ms": round(us / 1e3 / steps, 3)}
                                   for name, (n, us) in zip(("under_5us", "5_to_50us", "over_50us"), gaps)},
            "top": [{"name": n[:120], "ms_per_step": round(sum(d) / 1e3 / steps, 4), "calls_per_step": len(d) / steps,
                     "mean_us": round(sum(d) / len(d), 2)} for n, d in top],
            "long_gaps_by_neighbours": [{"between": k, "per_step": round(len(d) / steps, 2),
                                         "ms_per_step": round(sum(d) / 1e3 / steps, 3)}
                                        for k, d in sorted(long_gaps.items(), key=lambda kv: -sum(kv[1]))[:12]]}


def host_profile(engine, history, sessions, n: int) -> list[dict]:
    """The host's time by function over n decode tokens (cProfile): the 25 largest by own time."""
    prof = cProfile.Profile()
    prof.enable()
    decode(engine, history, sessions, n)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) → (calls, prim calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]
    short = lambda f: "engine/" + f.split("/engine/")[-1] if "/engine/" in f else f.split("site-packages/")[-1][-60:]  # noqa: E731
    return [{"fn": f"{short(f)}:{line} {name}", "calls_per_token": round(c / n, 1),
             "own_ms_per_token": round(own * 1e3 / n, 3), "cum_ms_per_token": round(cum * 1e3 / n, 3)}
            for (f, line, name), (c, _, own, cum, _) in rows]


def host_syncs(engine, history, sessions, n: int) -> list[dict]:
    """Every call that waited for the GPU over n decode tokens, by the engine frames that made it."""
    found: dict[str, int] = {}

    def seen(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/engine/" in f.filename]
        where = " < ".join(f"{f.filename.split('/engine/')[-1]}:{f.lineno} {f.name}" for f in frames[::-1][:4])
        key = f"{str(message)[:80]} @ {where}"
        found[key] = found.get(key, 0) + 1

    torch.cuda.set_sync_debug_mode("warn")
    old = warnings.showwarning
    warnings.showwarning = seen
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = seen
            decode(engine, history, sessions, n)
    finally:
        warnings.showwarning = old
        torch.cuda.set_sync_debug_mode(0)
    return [{"where": k, "per_token": round(v / n, 2)} for k, v in sorted(found.items(), key=lambda kv: -kv[1])]


def main() -> None:
    out = sys.argv[1]
    model = sys.argv[2] if len(sys.argv) > 2 else "synthetic:qwen3-30b-a3b"
    policies = (sys.argv[3] if len(sys.argv) > 3 else "adaptive,on-demand").split(",")
    context = int(sys.argv[4]) if len(sys.argv) > 4 else 2048
    bs = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    cuda = torch.cuda.is_available()  # without: the simulated GPU (a smoke test of this script)
    engine = Engine(EngineConfig(model=model, backend="tandem", device="cuda" if cuda else "cpu",
                                 simulate_hybrid=not cuda, expert_policy=policies[0],
                                 vram_budget_gb=24.0, max_batch=bs, cpu_threads=15,
                                 max_context=context_needed([context], WARM + 3 * TIMED, len(policies), True)))
    gen = torch.Generator().manual_seed(0)
    vocab = engine.info()["vocab_size"]
    history = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(bs)]
    sessions = [f"s{i}" for i in range(bs)]
    record = {"model": model, "context": context, "batch": bs, "runs": []}
    try:
        decode(engine, history, sessions, 1)  # the shared prefill
        for policy in policies:
            if engine.info()["expert_policy"] != policy:
                engine.set_expert_policy(policy)
            decode(engine, history, sessions, WARM)
            if cuda:
                torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
                wall = decode(engine, history, sessions, TIMED)
                if cuda:
                    torch.cuda.synchronize()
            run = {"policy": policy, "tok_s": round(bs * TIMED / wall, 2),
                   "decode_form": (engine.info()["cuda_graphs"] or {}).get("decode_form"),
                   **summarise(device_intervals(prof), TIMED, wall)}
            run["host_by_function"] = host_profile(engine, history, sessions, TIMED)
            if cuda:
                run["host_syncs"] = host_syncs(engine, history, sessions, 4)
            record["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k not in ("top", "host_by_function", "host_syncs")}),
                  flush=True)
            for key in ("top", "long_gaps_by_neighbours", "host_syncs", "host_by_function"):
                for row in run.get(key, [])[:12]:
                    print("   ", key, row, flush=True)
    finally:
        engine.close()
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
