"""Diagnostic: the first long prompt after a load against the same prompt again, Tandem alone, one
Q4_K_M file under an 8 GB budget (the suite's gpu-q4km-prefill-32k plan).

    PYTHONPATH=TREE python3 first_prompt.py FILE.gguf [TOKENS]

A 512-token warm-up (the suite's warm-up before this session), then TOKENS (default 32,768) twice:
the first is what a user's first long paste costs, the second the steady rate llama-bench reports."""
import sys
import time

from engine.api import Engine, EngineConfig, GenerationRequest

n = int(sys.argv[2]) if len(sys.argv) > 2 else 32768
t0 = time.perf_counter()
e = Engine(EngineConfig(model=sys.argv[1], backend="tandem", max_context=n + 96, max_batch=1, vram_budget_gb=8.0))
print("load_s", round(time.perf_counter() - t0, 1), flush=True)
ids = lambda k, s: [100 + (i * 7 + s) % 20000 for i in range(k)]  # noqa: E731
req = lambda p: GenerationRequest(prompt_ids=p, max_new_tokens=1, greedy=True, ignore_eos=True)  # noqa: E731
e.generate_batch([req(ids(512, 1))])
for label, seed in (("first", 2), ("second", 3)):
    t = time.perf_counter()
    r = e.generate_batch([req(ids(n, seed))])[0]
    print(label, n, "prefill_tok_s", round(r.prefill_tok_s, 1), "wall_s", round(time.perf_counter() - t, 2), flush=True)
print("plan", {k: e.info().get("plan", {}).get(k) for k in ("expert_policy", "kv_policy", "expert_cache_slots")})
e.close()
