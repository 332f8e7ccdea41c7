"""Diagnostic: where a resident decode step over GGUF blocks on the GPU spends its time.

    python3 benchmarks/h200/decode_profile.py OUT_DIR [LAYERS] [TOKENS]

Exports synthetic:qwen3-30b-a3b-L<LAYERS> (published shapes, random weights) as F32 GGUF, requantises it
with gguf-py (experts Q4_0 gate/up, Q8_0 down; dense Q8_0: no llama.cpp build needed), loads it resident
on the GPU with default settings (dtype auto: blocks on the device; the decode step as CUDA graphs),
times a TOKENS-token decode after a warm-up, then profiles one more: per token, the kernels launched,
the device time they take (their durations summed) and the wall time, so that the share of a token
spent between kernels shows; and the kernels by device time. Writes decode.json and decode-profile.txt."""
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path[:0] = ["tests", "tests/quant"]
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf_requantise import requantise  # noqa: E402
from test_gguf_blocks_on_gpu import export_f32  # noqa: E402

from engine.api import Engine, EngineConfig, GenerationRequest  # noqa: E402

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
dev = "cuda" if torch.cuda.is_available() else "cpu"
dims = {} if dev == "cuda" else dict(hidden_size=256, moe_intermediate_size=256, num_experts=8, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64)  # a CPU check of the script: tiny
import engine.bench.gguf_export  # noqa: E402,F401
src = export_f32(out, "qwen3_moe", "qwen3-30b-a3b", num_hidden_layers=layers, **dims)
q = requantise(src, out / "q.gguf", {"gate": T.Q4_0, "up": T.Q4_0, "down": T.Q8_0}, T.Q8_0)
e = Engine(EngineConfig(model=str(q), backend="tandem", device=dev, max_context=1024, max_batch=1))
prompt = [3 + (i * 7) % 120 for i in range(32)]  # the export's 128-token vocabulary
req = lambda n: GenerationRequest(prompt_ids=prompt, max_new_tokens=n, greedy=True, ignore_eos=True)  # noqa: E731
e.generate(req(16))  # graphs captured, kernels compiled
t = time.perf_counter()
r = e.generate(req(tokens))
result = {"layers": layers, "tokens": tokens, "device": dev, "decode_tok_s": round(r.decode_tok_s, 1),
          "info": {k: e.info().get(k) for k in ("expert_policy", "weight_types", "cuda_graphs", "cpu_decode")}}
from torch.profiler import ProfilerActivity, profile  # noqa: E402

acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
with profile(activities=acts) as prof:
    t = time.perf_counter()
    e.generate(req(tokens))
    wall = time.perf_counter() - t
kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
by_name = defaultdict(lambda: [0, 0.0])
for ev in kernels:
    by_name[ev.name][0] += 1
    by_name[ev.name][1] += ev.time_range.elapsed_us()  # a kernel event's own span on the device
result["profiled"] = {"wall_ms_per_token": round(wall / tokens * 1e3, 3),  # the prompt's prefill included
                      "kernels_per_token": round(len(kernels) / tokens, 1),
                      "kernel_ms_per_token": round(sum(v[1] for v in by_name.values()) / tokens / 1e3, 3)}
top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]
text = "\n".join(f"{us / tokens:9.1f} µs/token  {n / tokens:6.1f}/token  {name[:120]}" for name, (n, us) in top)
text += "\n\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
(out / "decode-profile.txt").write_text(text)
(out / "decode.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result), flush=True)
print(text[:4000])
e.close()
