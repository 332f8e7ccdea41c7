"""Diagnostic: the one decode graph's CPU share swept beside on-demand and cpu-only on one shared KV.
FORM=graph forces adaptive's step form to the one graph. argv: MODEL CONTEXT POLICIES JSON [BUDGET]"""
import json, os, sys
from engine.experts import mode_chooser
if os.environ.get("FORM", "chooser") == "graph":
    mode_chooser.ModeChooser.form = lambda self, B: "graph"
from engine.bench import experts

model, ctx, pols, out = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
budget = float(sys.argv[5]) if len(sys.argv) > 5 else 8.0
rec = experts.run(model=model, policies=pols, batch_sizes=(1,), contexts=(ctx,), new_tokens=64,
                  vram_budget_gb=budget, shared_prefill=True, rounds=2)
json.dump(rec, open(out, "w"), indent=1, default=str)
prev = {}
for r in rec["results"]:
    zc = r.get("zero_copy") or {}
    mb = zc.get("cpu_mailbox") or {}
    n, s = mb.get("experts", 0) - prev.get("experts", 0), mb.get("cpu_s", 0) - prev.get("cpu_s", 0)
    if "experts" in mb:
        prev = mb
    d = r["decode"]
    print(r["policy"], "round", r["round"], "slots", r["slots"], "decode", d["tok_s"], "hit", d["hit_rate"],
          "pcie", d["pcie_gbps"], "cpu_exec", d["cpu_executed"], "mbox_experts", n, "mbox_s", round(s, 4),
          "ms/expert", round(1e3 * s / n, 3) if n else None,
          "GBps", round(n * rec["expert_mib_each"] * 2**20 / s / 1e9, 1) if n and s else None,
          "zc", json.dumps({k: zc.get(k) for k in ("graph_steps", "zero_copy_experts", "cpu_experts", "missed_per_step")}),
          flush=True)
print("store", rec["store_gib"], "GiB, expert", rec["expert_mib_each"], "MiB, prefill",
      rec["results"][0]["prefill"]["tok_s"], "pinning", rec.get("cpu_expert_pinning"))
