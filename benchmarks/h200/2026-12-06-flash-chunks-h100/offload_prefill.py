"""Diagnostic: prefill under 8 GB with the default four chats (the plan caches the experts), by tokens a
forward and expert policy, Tandem alone, one Q4_K_M file; each prompt once untimed first.

    PYTHONPATH=TREE python3 offload_prefill.py MODEL [TOKENS]   (a .gguf file or a synthetic: preset)"""
import json
import sys

from engine.api import Engine, EngineConfig, GenerationRequest

n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
ids = lambda k, s: [100 + (i * 7 + s) % 20000 for i in range(k)]  # noqa: E731
req = lambda p: GenerationRequest(prompt_ids=p, max_new_tokens=1, greedy=True, ignore_eos=True)  # noqa: E731
for policy in ("auto", "on-demand"):
    e = Engine(EngineConfig(model=sys.argv[1], backend="tandem", max_context=32768 + 64, vram_budget_gb=8.0,
                            max_batch=4, expert_policy=policy))
    plan = e.info().get("plan") or {}
    print(policy, json.dumps({k: plan.get(k) for k in ("kv_policy", "expert_policy", "expert_cache_slots",
                                                        "predicted_prefill_tok_s")}), flush=True)
    for chunk in (512, 2048):
        e.backend.generator.prefill_chunk = chunk
        e.generate_batch([req(ids(n, 1))])
        r = e.generate_batch([req(ids(n, 2))])[0]
        ex = (e.stats().to_dict().get("experts") or {})
        print(policy, "chunk", chunk, "prefill", n, round(r.prefill_tok_s, 1),
              {k: v for k, v in ex.items() if isinstance(v, (int, float))}, flush=True)
    e.close()
