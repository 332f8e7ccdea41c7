"""Diagnostic: four chats' decode with the step form forced (FORM=graph or pieces) beside on-demand,
BF16, 8 GB, one shared KV. argv: MODEL CONTEXT JSON LABEL"""
import json, os, sys
from engine.experts import mode_chooser
form = os.environ.get("FORM", "chooser")
if form != "chooser":
    mode_chooser.ModeChooser.form = lambda self, B: form
from engine.bench import experts

model, ctx, out, label = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rec = experts.run(model=model, policies=["adaptive", "on-demand"], batch_sizes=(4,), contexts=(ctx,),
                  new_tokens=48, vram_budget_gb=8.0, shared_prefill=True, rounds=1)
json.dump(rec, open(out, "w"), indent=1, default=str)
for r in rec["results"]:
    zc = r.get("zero_copy") or {}
    d = r["decode"]
    print(label, form, ctx, r["policy"], "bs", r["batch"], "slots", r["slots"], "decode", d["tok_s"], "hit", d["hit_rate"],
          "pcie", d["pcie_gbps"], "cpu_exec", d["cpu_executed"],
          "zc", json.dumps({k: zc.get(k) for k in ("graph_steps", "cpu_experts", "cpu_split", "cpu_mailbox")}), flush=True)
