"""The app's and `tandem serve`'s default on a tight budget: the chats whose KV the plan holds, and a
long prompt read under that plan beside the plan of four chats (the default before), one file, Tandem
alone; each prompt once untimed first.

    PYTHONPATH=TREE python3 held_chats.py MODEL [BUDGET_GB] [TOKENS]   (a .gguf file or a synthetic: preset)"""
import sys

from engine.api import Engine, EngineConfig, GenerationRequest

model = sys.argv[1]
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 8.0
n = int(sys.argv[3]) if len(sys.argv) > 3 else 32768
ids = lambda k, s: [100 + (i * 7 + s) % 20000 for i in range(k)]  # noqa: E731
req = lambda p: GenerationRequest(prompt_ids=p, max_new_tokens=32, greedy=True, ignore_eos=True)  # noqa: E731
for chats in (None, 4):  # None: the plan's choice (the app's and serve's default)
    e = Engine(EngineConfig(model=model, backend="tandem", max_context=n + 64, vram_budget_gb=budget, max_batch=chats))
    plan = e.info()["plan"]
    print("asked", chats, "held", e.config.max_batch, plan["kv_policy"], plan["expert_policy"],
          plan["expert_cache_slots"], "|", plan["chats_reason"], flush=True)
    e.generate_batch([req(ids(n, 1))])
    r = e.generate_batch([req(ids(n, 2))])[0]
    print("asked", chats, "prefill", n, round(r.prefill_tok_s, 1), "decode", round(r.decode_tok_s, 1), flush=True)
    e.close()
