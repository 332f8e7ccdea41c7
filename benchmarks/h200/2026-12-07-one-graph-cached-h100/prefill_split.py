"""Diagnostic: prompts read with cached experts, adaptive against on-demand: prefill and decode tok/s,
what the adaptive split did (experts sent to the CPU, the driving thread's waits and host parts), and
the online corrections (CPU sets; split and whole layer steps). Tandem alone, one model, 8 GB, four
chats' KV planned (so the experts are cached); the prompt once untimed first.

    PYTHONPATH=TREE python3 prefill_split.py MODEL [TOKENS] [LABEL]   (a .gguf file or a synthetic: preset)"""
import json
import os
import sys

from engine.api import Engine, EngineConfig, GenerationRequest

n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
label = sys.argv[3] if len(sys.argv) > 3 else ""
ctx = int(sys.argv[4]) if len(sys.argv) > 4 else 32768  # the KV of four such chats pushes experts into slots
ids = lambda k, s: [100 + (i * 7 + s) % 20000 for i in range(k)]  # noqa: E731
req = lambda p, m: GenerationRequest(prompt_ids=p, max_new_tokens=m, greedy=True, ignore_eos=True)  # noqa: E731
keep = ("hits", "misses", "fills", "cpu_executed", "cpu_expert_s", "cpu_wait_s", "device_wait_s", "run_s",
        "host_split_s", "cpu_correction", "step_ratio", "slots")


def delta(after, before):
    out = {}
    for k in keep:
        a, b = after.get(k), before.get(k)
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            out[k] = round(a - (b or 0), 3)
        elif k == "host_split_s" and isinstance(a, dict):
            out[k] = {p: round(v - (b or {}).get(p, 0), 3) for p, v in a.items()}
        elif a is not None:
            out[k] = a
    return out


for policy in os.environ.get("POLICIES", "adaptive on-demand").split():
    e = Engine(EngineConfig(model=sys.argv[1], backend="tandem", max_context=max(ctx, n + 64), vram_budget_gb=8.0,
                            max_batch=4, expert_policy=policy))
    e.generate_batch([req(ids(n, 1), 1)])
    before = e.stats().to_dict().get("experts") or {}
    r = e.generate_batch([req(ids(n, 2), 1)])[0]
    after = e.stats().to_dict().get("experts") or {}
    d = e.generate_batch([req(ids(512, 3), int(os.environ.get("DECODE", 64)))])[0]
    zc = (e.stats().to_dict().get("experts") or {}).get("zero_copy")
    graphs = getattr(e.backend.generator, "graphs", None)
    gt = graphs.telemetry() if hasattr(graphs, "telemetry") else None
    print(label, policy, "forward", e.backend.generator.prefill_chunk, "prefill", n, round(r.prefill_tok_s, 1),
          "decode", round(d.decode_tok_s, 1), "ttft", round(d.ttft_s, 3), json.dumps(delta(after, before)), "zero_copy", json.dumps(zc), "graphs", json.dumps(gt, default=str), flush=True)
    e.close()
