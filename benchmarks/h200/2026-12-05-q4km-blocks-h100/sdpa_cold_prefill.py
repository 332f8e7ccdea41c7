import json, sys, time, runpy
import torch
sys.path[:0] = ["tests", "tests/quant"]
from gguf import GGMLQuantizationType as T
from gguf_requantise import requantise
from test_gguf_blocks_on_gpu import export_f32
from pathlib import Path
from engine.api import Engine, EngineConfig, GenerationRequest
out = Path("/tmp/pp2"); out.mkdir(exist_ok=True)
src = export_f32(out, "qwen3_moe", "qwen3-30b-a3b", num_hidden_layers=1)
q = requantise(src, out / "q.gguf", {"gate": T.Q4_0, "up": T.Q4_0, "down": T.Q8_0}, T.Q8_0)
ids = lambda k, s: [3 + (i * 7 + s) % 120 for i in range(k)]
req = lambda p: GenerationRequest(prompt_ids=p, max_new_tokens=1, greedy=True, ignore_eos=True)
for cudnn in (False, True):
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    e = Engine(EngineConfig(model=str(q), backend="tandem", device="cuda", max_context=4096, max_batch=1, expert_policy="resident"))
    e.generate_batch([req(ids(512, 1))])
    rates = []
    for n in (2048, 2048, 1500, 1900, 700):
        t0 = time.perf_counter(); r = e.generate_batch([req(ids(n, n))])[0]; rates.append((n, round(r.prefill_tok_s), round(time.perf_counter() - t0, 3)))
    print(json.dumps({"cudnn_sdp": cudnn, "prefill (tokens, tok/s, s)": rates}), flush=True)
    e.close()
