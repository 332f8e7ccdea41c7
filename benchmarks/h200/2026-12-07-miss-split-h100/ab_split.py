"""A/B diagnostic: adaptive as shipped (the chooser) beside on-demand and cpu-only on one shared KV,
BF16, 8 GB, one chat. argv: MODEL CONTEXT JSON LABEL; POLICIES (comma list) replaces the three."""
import json, os, sys
from engine.bench import experts

model, ctx, out, label = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rec = experts.run(model=model, policies=os.environ.get("POLICIES", "adaptive,on-demand,cpu-only").split(","), batch_sizes=(1,), contexts=(ctx,),
                  new_tokens=64, vram_budget_gb=8.0, shared_prefill=True, rounds=1)
json.dump(rec, open(out, "w"), indent=1, default=str)
for r in rec["results"]:
    zc = r.get("zero_copy") or {}
    d = r["decode"]
    print(label, ctx, r["policy"], "slots", r["slots"], "decode", d["tok_s"], "hit", d["hit_rate"], "pcie", d["pcie_gbps"],
          "cpu_exec", d["cpu_executed"], "zc", json.dumps({k: zc.get(k) for k in ("graph_steps", "cpu_experts", "cpu_split", "cpu_mailbox")}),
          flush=True)
print(label, "graphs", json.dumps(rec.get("results")[0].get("cuda_graphs"), default=str)[:300])
