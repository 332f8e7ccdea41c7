"""Diagnostic: a tree's prefill rate on gpt-oss (attention sinks; every other layer a 128-token window),
resident, one chat, Tandem alone; each size once untimed first.

    PYTHONPATH=TREE python3 ab_sinks.py LABEL [MODEL]   (default synthetic:gpt-oss-20b-L4, BF16 random weights)

Run from two trees in turn on one machine (this commit's, then a `git archive` of the base): the A/B."""
import sys

from engine.api import Engine, EngineConfig, GenerationRequest

model = sys.argv[2] if len(sys.argv) > 2 else "synthetic:gpt-oss-20b-L4"
e = Engine(EngineConfig(model=model, backend="tandem", max_context=16384 + 96, max_batch=1))
ids = lambda k, s: [100 + (i * 7 + s) % 20000 for i in range(k)]  # noqa: E731
req = lambda p: GenerationRequest(prompt_ids=p, max_new_tokens=1, greedy=True, ignore_eos=True)  # noqa: E731
for n in (2048, 16384):
    e.generate_batch([req(ids(n, 1))])
    r = e.generate_batch([req(ids(n, 2))])[0]
    print(sys.argv[1], "prefill", n, round(r.prefill_tok_s, 1), flush=True)
e.close()
