"""Where a resident decode step's GPU time goes: torch.profiler over eager decode steps, kernels summed.

    python3 benchmarks/h200/profile_decode.py --model synthetic:qwen3-30b-a3b-L16 --context 8192 --batch 1

Prints the kernels by total CUDA time per step, the kernel count per step, and writes JSON (--json).
Eager steps: the graphs replay the same kernels, so the kernel sum is the floor a graph can reach.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine.api import Engine, EngineConfig, GenerationRequest
from engine.bench.e2e import fill_session


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="synthetic:qwen3-30b-a3b-L16")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    engine = Engine(EngineConfig(model=ns.model, backend="tandem", device="cuda", max_batch=ns.batch,
                                 max_context=ns.context + 64, cuda_graphs=False))
    gen = torch.Generator().manual_seed(0)
    keys = [f"p{i}" for i in range(ns.batch)]
    prompts = [fill_session(engine, k, ns.context, gen) for k in keys]
    reqs = lambda n: [GenerationRequest(prompt_ids=pr + [1], max_new_tokens=n, greedy=True, ignore_eos=True,  # noqa: E731
                                        session_id=k) for pr, k in zip(prompts, keys)]
    engine.generate_batch(reqs(4))  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.generate_batch(reqs(ns.steps + 1))  # one prefill token + steps decode steps
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    rows = []
    for e in prof.key_averages():
        cuda_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if cuda_us and e.device_type.name == "CUDA":
            rows.append({"kernel": e.key[:90], "calls_per_step": e.count / (ns.steps + 1),
                         "us_per_step": cuda_us / (ns.steps + 1)})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    calls = sum(r["calls_per_step"] for r in rows)
    n_layers = engine.info()["layers"]
    print(f"{ns.model} bs={ns.batch} L={ns.context}: kernels {total / 1e3:.3f} ms/step, {calls:.0f} launches/step "
          f"({calls / n_layers:.1f}/layer), wall {wall / (ns.steps + 1) * 1e3:.2f} ms/step (eager, profiled)")
    for r in rows[:25]:
        print(f"  {r['us_per_step']:9.1f} us  {r['calls_per_step']:6.1f}x  {r['kernel']}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"model": ns.model, "batch": ns.batch, "context": ns.context, "kernel_ms_per_step": total / 1e3,
                       "launches_per_step": calls, "layers": n_layers, "kernels": rows}, f, indent=1)
    engine.close()


if __name__ == "__main__":
    main()
