"""Diagnostic: decode with every expert in a cache slot, adaptive (one graph) against on-demand
(pieces): tok/s, the chooser's step times, and the CUDA kernels of 32 steps by total time.
    PYTHONPATH=TREE python3 graph_profile.py MODEL CTX LABEL"""
import json, os, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from engine.api import Engine, EngineConfig, GenerationRequest

model, ctx, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ids = lambda k, s: [100 + (i * 7 + s) % 20000 for i in range(k)]  # noqa: E731
req = lambda p, m: GenerationRequest(prompt_ids=p, max_new_tokens=m, greedy=True, ignore_eos=True)  # noqa: E731
for policy in os.environ.get("POLICIES", "adaptive on-demand").split():
    e = Engine(EngineConfig(model=model, backend="tandem", max_context=ctx, vram_budget_gb=8.0, max_batch=4,
                            expert_policy=policy))
    e.generate_batch([req(ids(4096, 1), 1)])
    d = e.generate_batch([req(ids(512, 2), 256)])[0]
    ex = e.stats().to_dict().get("experts") or {}
    print(label, policy, "decode256", round(d.decode_tok_s, 1), "hits", ex.get("hits"), "misses", ex.get("misses"),
          "slots", ex.get("slots"), flush=True)
    g = e.backend.generator.graphs
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        d = e.generate_batch([req(ids(512, 3), 32)])[0]
        torch.cuda.synchronize()
    print(label, policy, "decode32 profiled", round(d.decode_tok_s, 1), "graphs", json.dumps(g.telemetry(), default=str))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=28, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=70))
    d = e.generate_batch([req(ids(512, 4), 128)])[0]
    print(label, policy, "decode128 after", round(d.decode_tok_s, 1), json.dumps(e.stats().to_dict().get("experts"), default=str)[:3000], flush=True)
    e.close()
