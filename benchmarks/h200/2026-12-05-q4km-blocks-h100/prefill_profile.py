"""Diagnostic: where a resident prefill over GGUF blocks on the GPU spends its time.

    python3 prefill_profile.py OUT_DIR [LAYERS] [PROMPT]

Exports synthetic:qwen3-30b-a3b-L<LAYERS> (published shapes, random weights) as F32 GGUF, requantises it
with gguf-py (experts Q4_0 gate/up, Q8_0 down; dense Q8_0: no llama.cpp build needed), loads it resident
on the GPU (dtype auto: blocks on the device), warms up with a 512-token prompt, times three PROMPT-token
prefills, then profiles one: the top operators by device time and by host time."""
import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = ["tests", "tests/quant"]
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf_requantise import requantise  # noqa: E402
from test_gguf_blocks_on_gpu import export_f32  # noqa: E402

from engine.api import Engine, EngineConfig, GenerationRequest  # noqa: E402

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
n = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
dev = "cuda" if torch.cuda.is_available() else "cpu"
t0 = time.perf_counter()
dims = {} if dev == "cuda" else dict(hidden_size=256, moe_intermediate_size=256, num_experts=8, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64)  # a CPU check of the script: tiny
import engine.bench.gguf_export  # noqa: E402,F401
src = export_f32(out, "qwen3_moe", "qwen3-30b-a3b", num_hidden_layers=layers, **dims)
q = requantise(src, out / "q.gguf", {"gate": T.Q4_0, "up": T.Q4_0, "down": T.Q8_0}, T.Q8_0)
made = time.perf_counter() - t0
e = Engine(EngineConfig(model=str(q), backend="tandem", device=dev, max_context=n + 64, max_batch=1,
                        expert_policy="resident"))
ids = lambda k, s: [3 + (i * 7 + s) % 120 for i in range(k)]  # noqa: E731 (the export's 128-token vocabulary)
req = lambda p: GenerationRequest(prompt_ids=p, max_new_tokens=1, greedy=True, ignore_eos=True)  # noqa: E731
e.generate_batch([req(ids(min(512, n), 1))])
rates = [round(e.generate_batch([req(ids(n, s))])[0].prefill_tok_s, 1) for s in (2, 3, 4)]
result = {"layers": layers, "prompt": n, "device": dev, "make_s": round(made, 1), "prefill_tok_s": rates,
          "info": {k: e.info().get(k) for k in ("expert_policy", "weight_types", "cuda_graphs")}}
print(json.dumps(result), flush=True)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
with profile(activities=acts) as prof:
    e.generate_batch([req(ids(n, 5))])
table = prof.key_averages()
text = (table.table(sort_by="self_cuda_time_total" if dev == "cuda" else "self_cpu_time_total", row_limit=30)
        + "\n" + table.table(sort_by="self_cpu_time_total", row_limit=30))
(out / "prefill-profile.txt").write_text(text)
(out / "prefill.json").write_text(json.dumps(result))
print(text[:6000])
e.close()
