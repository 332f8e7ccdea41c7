"""Diagnostic: prefill with cached experts, adaptive against on-demand, with what the adaptive split
did (experts sent to the CPU, its measured / modelled CPU time by phase); Tandem alone, one model,
8 GB, four chats' KV planned (so the experts are cached); each prompt once untimed first.

    PYTHONPATH=TREE python3 prefill_split.py MODEL [TOKENS]   (a .gguf file or a synthetic: preset)"""
import json
import sys

from engine.api import Engine, EngineConfig, GenerationRequest

n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
ids = lambda k, s: [100 + (i * 7 + s) % 20000 for i in range(k)]  # noqa: E731
req = lambda p: GenerationRequest(prompt_ids=p, max_new_tokens=1, greedy=True, ignore_eos=True)  # noqa: E731
keep = ("hits", "misses", "fills", "cpu_executed", "cpu_expert_s", "cpu_wait_s", "device_wait_s", "run_s",
        "cpu_correction", "slots")
for policy in ("adaptive", "on-demand"):
    e = Engine(EngineConfig(model=sys.argv[1], backend="tandem", max_context=n + 64, vram_budget_gb=8.0,
                            max_batch=4, expert_policy=policy))
    e.generate_batch([req(ids(n, 1))])
    before = e.stats().to_dict().get("experts") or {}
    r = e.generate_batch([req(ids(n, 2))])[0]
    after = e.stats().to_dict().get("experts") or {}
    delta = {k: (round(after[k] - before.get(k, 0), 3) if isinstance(after.get(k), (int, float)) else after.get(k))
             for k in keep if k in after}
    print(policy, "forward", e.backend.generator.prefill_chunk, "prefill", n, round(r.prefill_tok_s, 1),
          json.dumps(delta), flush=True)
    e.close()
