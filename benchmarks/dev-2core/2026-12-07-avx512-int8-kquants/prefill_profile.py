import sys, time, collections
import torch
from engine.api import Engine, EngineConfig, GenerationRequest
from engine.quant import experts as qe, matmul as qm
T = collections.defaultdict(float); N = collections.Counter()
def wrap(mod, name, key):
    f = getattr(mod, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[key] += time.perf_counter() - t; N[key] += 1; return r
    setattr(mod, name, g)
orig_run = qe.QuantResidentExperts.run
def run(self, *a, **k):
    t = time.perf_counter(); r = orig_run(self, *a, **k); T["experts.run"] += time.perf_counter() - t; return r
qe.QuantResidentExperts.run = run
wrap(qe, "swiglu_blocks", "heavy swiglu_blocks")
orig_ql = qm.quant_linear
def ql(x, w, *a, **k):
    t = time.perf_counter(); r = orig_ql(x, w, *a, **k); T[f"quant_linear n={'>16' if x.shape[0]>16 else '<=16'}"] += time.perf_counter() - t; return r
qm.quant_linear = ql; qe.quant_linear = ql
e = Engine(EngineConfig(model=sys.argv[1], backend="tandem"))
ids = [100 + (i * 7) % 20000 for i in range(512)]
req = GenerationRequest(prompt_ids=ids, max_new_tokens=1, greedy=True, ignore_eos=True)
e.generate_batch([req]); T.clear(); N.clear()
t = time.perf_counter(); r = e.generate_batch([GenerationRequest(prompt_ids=[i + 1 for i in ids], max_new_tokens=1, greedy=True, ignore_eos=True)])[0]
print("total", round(time.perf_counter() - t, 3), "prefill tok/s", getattr(r, "prefill_tok_s", None))
for k, v in sorted(T.items(), key=lambda kv: -kv[1]): print(f"{k:36s} {v:.3f} s  calls {N[k]}")
