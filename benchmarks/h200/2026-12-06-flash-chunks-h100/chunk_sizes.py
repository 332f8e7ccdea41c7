"""Diagnostic: prefill rate by tokens per prefill forward (the generator's `prefill_chunk`), Tandem alone,
one Q4_K_M file, resident (no budget) and under 8 GB, each size warm (its prompt run once untimed).

    PYTHONPATH=TREE python3 chunk_sizes.py FILE.gguf"""
import sys

from engine.api import Engine, EngineConfig, GenerationRequest

ids = lambda k, s: [100 + (i * 7 + s) % 20000 for i in range(k)]  # noqa: E731
req = lambda p: GenerationRequest(prompt_ids=p, max_new_tokens=1, greedy=True, ignore_eos=True)  # noqa: E731
for budget in (None, 8.0):
    e = Engine(EngineConfig(model=sys.argv[1], backend="tandem", max_context=32768 + 96, max_batch=1,
                            vram_budget_gb=budget))
    for chunk in (512, 1024, 2048, 4096):
        e.backend.generator.prefill_chunk = chunk
        for n in (2048, 32768):
            e.generate_batch([req(ids(n, 1))])
            r = e.generate_batch([req(ids(n, 2))])[0]
            print("budget", budget, "chunk", chunk, "prefill", n, round(r.prefill_tok_s, 1), flush=True)
    e.close()
