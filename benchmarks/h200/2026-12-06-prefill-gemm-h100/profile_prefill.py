"""Diagnostic: the plan under an 8 GB budget for a 32K context, an N-token prefill's rate, then the torch
profile of a 2,048-token prefill (top operators by device time, then by host time).

    PYTHONPATH=TREE python3 profile_prefill.py FILE.gguf N"""
import json
import sys
import time

from torch.profiler import ProfilerActivity, profile

from engine.api import Engine, EngineConfig, GenerationRequest

n = int(sys.argv[2])
e = Engine(EngineConfig(model=sys.argv[1], backend="tandem", max_context=32768 + 96, max_batch=1, vram_budget_gb=8.0))
info = e.info()
print(json.dumps({k: info.get(k) for k in ("expert_policy", "plan", "experts")}, default=str)[:2500])
ids = lambda k, s: [100 + (i * 7 + s) % 20000 for i in range(k)]  # noqa: E731
req = lambda p: GenerationRequest(prompt_ids=p, max_new_tokens=1, greedy=True, ignore_eos=True)  # noqa: E731
e.generate_batch([req(ids(512, 1))])
t = time.perf_counter()
r = e.generate_batch([req(ids(n, 2))])[0]
print("prefill", n, r.prefill_tok_s, time.perf_counter() - t)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    e.generate_batch([req(ids(2048, 3))])
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
