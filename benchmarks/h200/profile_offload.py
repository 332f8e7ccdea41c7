"""Where the GPU-driving thread spends a decode step with offloaded experts, per policy (cProfile).

    python3 benchmarks/h200/profile_offload.py MODEL SLOTS OUT_DIR [policies] [form]

form (adaptive only): "graph" or "pieces" forces that decode form instead of the measured choice.

Loads MODEL once with SLOTS expert cache slots, and for each policy and batch size 1 and 4: a
512-token random prompt, 4 sampled warm-up tokens (graph capture, compiles), then 16 sampled decode
tokens timed without the profiler (with the executor's own split of the driving thread's time:
device wait, CPU wait, host parts; the worker's queue and compute time of the CPU sets) and 16 more
under cProfile. SWITCH_INTERVAL=seconds sets the GIL switch interval first; CPU_THREADS the CPU
sets' threads (default 15). Writes OUT_DIR/profile-offload.json
and one text profile per run (functions by own time, then by cumulative time).
"""

import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

from engine.api import Engine, EngineConfig, GenerationRequest


def decode_batch(engine, history: list[list[int]], sessions: list[str], n: int) -> float:
    """n sampled tokens for each session (its history as the prompt; the history grows) → seconds."""
    reqs = [GenerationRequest(prompt_ids=h, max_new_tokens=n, temperature=1.0, seed=i, ignore_eos=True,
                              session_id=s) for i, (h, s) in enumerate(zip(history, sessions))]
    t0 = time.perf_counter()
    res = engine.generate_batch(reqs)
    dt = time.perf_counter() - t0
    for h, r in zip(history, res):
        h.extend(r.token_ids)
    return dt


def main() -> None:
    model, slots, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    policies = sys.argv[4].split(",") if len(sys.argv) > 4 else ["on-demand", "adaptive", "cpu-only"]
    form = sys.argv[5] if len(sys.argv) > 5 else None
    if os.environ.get("SWITCH_INTERVAL"):  # an experiment: the GIL handed to the CPU-set worker sooner
        sys.setswitchinterval(float(os.environ["SWITCH_INTERVAL"]))
    out.mkdir(parents=True, exist_ok=True)
    engine = Engine(EngineConfig(model=model, backend="tandem", device="cuda", expert_policy=policies[0],
                                 expert_cache_slots=slots, max_batch=4, max_context=1024,
                                 cpu_threads=int(os.environ.get("CPU_THREADS", 15))))
    vocab = engine.info()["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    record = {"model": model, "slots": slots, "cpu_threads": engine.config.cpu_threads,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "runs": []}
    try:
        for policy in policies:
            if engine.info()["expert_policy"] != policy:
                engine.set_expert_policy(policy)
            graphs = engine.backend.generator.graphs
            if form and graphs is not None and graphs.chooser is not None:
                graphs.chooser.form = lambda B: form  # forced
            for bs in (1, 4):
                sessions = [f"{policy}-{bs}-{i}" for i in range(bs)]
                history = [torch.randint(0, vocab, (512,), generator=gen).tolist() for _ in range(bs)]

                def decode(n: int) -> float:
                    return decode_batch(engine, history, sessions, n)

                decode(4)
                ex = engine.backend.parts.experts
                before = ex.telemetry()
                plain = decode(16)
                after = ex.telemetry()
                keys = ("run_s", "device_wait_s", "cpu_wait_s", "cpu_queue_s", "cpu_expert_s", "cpu_executed")
                spent = {k: round(after[k] - before[k], 4) for k in keys}
                spent["host_split_s"] = {k: round(after["host_split_s"][k] - before["host_split_s"][k], 4)
                                         for k in after["host_split_s"]}
                spent["layer_steps"] = 16 * len(ex.store.layers)
                prof = cProfile.Profile()
                prof.enable()
                profiled = decode(16)
                prof.disable()
                text = io.StringIO()
                stats = pstats.Stats(prof, stream=text)
                stats.sort_stats("tottime").print_stats(30)
                stats.sort_stats("cumulative").print_stats(40)
                (out / f"profile-{policy}-bs{bs}.txt").write_text(text.getvalue())
                run = {"policy": policy, "batch": bs, "tok_s": round(16 * bs / plain, 2), "decode_s": round(plain, 4),
                       "tok_s_profiled": round(16 * bs / profiled, 2), "hit_rate": engine.stats().experts.get("hit_rate"),
                       "executor": spent, "cuda_graphs": engine.info()["cuda_graphs"],
                       "zero_copy": engine.stats().experts.get("zero_copy")}
                record["runs"].append(run)
                print(json.dumps(run), flush=True)
                for s in sessions:
                    engine.end_session(s)
    finally:
        engine.close()
    (out / "profile-offload.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
