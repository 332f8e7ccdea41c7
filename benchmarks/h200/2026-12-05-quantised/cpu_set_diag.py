"""Throwaway diagnostic: why cpu-only decode over quantised experts is slow on the GPU host."""
import json, os, sys, time
import torch
from engine.api import Engine, EngineConfig, GenerationRequest

path, mode = sys.argv[1], sys.argv[2]
dev = "cuda" if torch.cuda.is_available() else "cpu"
kw = {"expert_policy": "cpu-only"} if mode.startswith("cpu-only") else {}
if mode.endswith("bf16"):
    kw["dtype"] = "bfloat16"
if dev == "cpu" and mode.startswith("cpu-only"):
    kw["simulate_hybrid"] = True
e = Engine(EngineConfig(model=path, device=dev if mode != "cpuengine" else "cpu", max_context=1024, **kw))
req = lambda n, s=0: GenerationRequest(prompt_ids=[100 + (i * 7 + s) % 900 for i in range(64)], max_new_tokens=n,
                                       greedy=True, ignore_eos=True)
e.generate_batch([req(16, 1)])
res = []
for s in range(3):
    r = e.generate_batch([req(128, s + 2)])[0]
    res.append(round(r.decode_tok_s, 1))
out = {"mode": mode, "env": {k: os.environ.get(k) for k in ("TANDEM_CPU_THREADS", "OMP_WAIT_POLICY")},
       "decode_tok_s": res, "torch_threads": torch.get_num_threads()}
st = e.stats()
d = st if isinstance(st, dict) else getattr(st, "__dict__", {})
out["experts"] = {k: v for k, v in (d.get("experts") or {}).items() if not isinstance(v, (list, dict))} if isinstance(d.get("experts"), dict) else str(d.get("experts"))[:800]
info = e.info(); out["kernels"] = info.get("kernels"); out["expert_policy"] = info.get("expert_policy")
if len(sys.argv) > 3:  # profile one generation
    from torch.profiler import profile, ProfilerActivity
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        e.generate_batch([req(32, 9)])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
e.close()
print(json.dumps(out))
