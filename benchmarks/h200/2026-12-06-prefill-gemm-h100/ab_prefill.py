"""Diagnostic: a tree's prefill rate at 2K, 16K and 32K on one Q4_K_M file under an 8 GB budget, each
size after the smaller ones (so the caching allocator is warm), Tandem alone.

    PYTHONPATH=TREE python3 ab_prefill.py LABEL FILE.gguf

Run from two trees in turn on one machine (this commit's, then a `git archive` of the base): the A/B."""
import sys

from engine.api import Engine, EngineConfig, GenerationRequest

e = Engine(EngineConfig(model=sys.argv[2], backend="tandem", max_context=32768 + 96, max_batch=1, vram_budget_gb=8.0))
ids = lambda k, s: [100 + (i * 7 + s) % 20000 for i in range(k)]  # noqa: E731
req = lambda p: GenerationRequest(prompt_ids=p, max_new_tokens=1, greedy=True, ignore_eos=True)  # noqa: E731
e.generate_batch([req(ids(512, 1))])  # compiles and warms the prefill paths
for n in (2048, 16384, 32768):
    r = e.generate_batch([req(ids(n, 2))])[0]
    print(sys.argv[1], "prefill", n, round(r.prefill_tok_s, 1), flush=True)
