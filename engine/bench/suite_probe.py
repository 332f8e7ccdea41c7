"""One measurement of one engine, in its own process: what `tandem bench suite` runs each round.

    python suite_probe.py '{"config": {"model": "builtin:smollm2-135m", "backend": "tandem"}, ...}'

The suite starts this file as a script with PYTHONPATH set to the source tree under test (this one,
or a git worktree of another commit for `--against`), so it must run on any commit's engine: it
imports only the names DESIGN.md §9 keeps stable (`engine.api`'s Engine, EngineConfig,
GenerationRequest) and the standard library, and nothing else of the tree that starts it.

Spec keys: config (EngineConfig fields), vocab (prompt ids are drawn below it), prefill (prompt
tokens of the timed prefill; 0: none), decode_prompt (prompt tokens before the timed decode),
decode_prompts (several such lengths, decoded in turn by the one loaded engine: `decode_tok_s_by_prompt`,
and `prefill_tok_s_by_prompt` of the prompts before them),
new_tokens, batch (chats decoded together), seed, warmup and warmup_tokens (an untimed short
generation first: kernel compiles, allocator growth, graph capture; its prompt as long as the longest
timed one, as llama-bench's warm-up run is: `warmup_prompt`). The result carries the engine's
expert, PCIe and kernel counters after the last generation (`stats`).
Prompts are fixed pseudo-random token ids (seeded; the same for every engine and round), as
`tandem generate --random-prompt` makes them. Prints one JSON object on its last line of stdout.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

VOCAB_FLOOR = 32_000  # ids drawn below this by default: the suite's models all have larger vocabularies


def prompt(n: int, seed: int, vocab: int = VOCAB_FLOOR) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(min(100, vocab // 2), vocab) for _ in range(n)]


def measure(spec: dict) -> dict:
    from engine.api import Engine, EngineConfig, GenerationRequest

    t0 = time.perf_counter()
    engine = Engine(EngineConfig(**spec["config"]))
    load_s = time.perf_counter() - t0
    import engine as engine_package

    seed, batch, vocab = int(spec.get("seed", 0)), int(spec.get("batch", 1)), int(spec.get("vocab", VOCAB_FLOOR))
    # which tree's engine ran: what an A/B run checks
    tree = os.path.dirname(os.path.dirname(os.path.abspath(engine_package.__file__)))
    out = {"load_s": round(load_s, 2), "tree": tree}
    try:
        def req(ids, n):
            return GenerationRequest(prompt_ids=ids, max_new_tokens=n, greedy=True, ignore_eos=True)

        if spec.get("warmup", True):
            n = int(spec.get("warmup_tokens", 8))
            engine.generate_batch([req(prompt(warmup_prompt(spec), seed + 99 + b, vocab), n) for b in range(batch)])
        if spec.get("prefill"):
            res = engine.generate_batch([req(prompt(int(spec["prefill"]), seed + b, vocab), 1) for b in range(batch)])
            # the engine's own prefill timer; a batch's rate counts every sequence's tokens
            out["prefill_tok_s"] = res[0].prefill_tok_s
            out["prefill_tokens"] = sum(r.prefilled_tokens for r in res)
        if spec.get("new_tokens") and not spec.get("decode_prompts"):
            ids = [prompt(int(spec.get("decode_prompt", 32)), seed + 10 + b, vocab) for b in range(batch)]
            res = engine.generate_batch([req(i, int(spec["new_tokens"])) for i in ids])
            # decode-phase tokens / decode-phase seconds, first token excluded (all sequences of a batch)
            out["decode_tok_s"] = res[0].decode_tok_s
            out["decode_tokens"] = sum(r.completion_tokens for r in res)
        if spec.get("decode_prompts"):  # one load for several contexts: a large file loads in minutes
            out["decode_tok_s_by_prompt"], out["prefill_tok_s_by_prompt"] = {}, {}
            for n in spec["decode_prompts"]:
                ids = [prompt(int(n), seed + 10 + b, vocab) for b in range(batch)]
                res = engine.generate_batch([req(i, int(spec.get("new_tokens", 32))) for i in ids])
                out["decode_tok_s_by_prompt"][str(n)] = res[0].decode_tok_s
                out["prefill_tok_s_by_prompt"][str(n)] = res[0].prefill_tok_s  # the prompt before that decode
        info = engine.info()
        out["info"] = {k: info.get(k) for k in ("backend", "model", "device", "dtype", "kv_policy", "expert_policy",
                                                 "llama_cpp", "native", "cuda_graphs")}  # graphs: captured or why not
        out["stats"] = _stats(engine)
        plan = info.get("plan")
        if isinstance(plan, dict):  # what the default (auto) plan chose, kept short
            out["plan"] = {k: plan.get(k) for k in ("kv_policy", "expert_policy", "expert_cache_slots", "bottleneck",
                                                     "predicted_decode_tok_s", "predicted_prefill_tok_s")
                           if k in plan}
    finally:
        engine.close()
    return out


def warmup_prompt(spec: dict) -> int:
    """Prompt tokens of the untimed warm-up: at least 16, and as long as the longest timed prompt, so that
    every path the timed prompt takes (its GEMM shapes and kernel compiles, the caching allocator's largest
    buffers, the KV pages) is warm, as llama-bench's warm-up run (the timed prompt itself) makes llama.cpp's.
    The first long prompt after a load is slower; that is a separate measure, not this cell's."""
    timed = max([int(spec.get("prefill") or 0), *map(int, spec.get("decode_prompts") or [0])])
    return max(16, timed)


def _stats(engine) -> dict:
    """The engine's counters after every generation of the probe (warm-up included), the scalars of the
    parts that say where a step's time went: the experts' (hits, fills, CPU-computed experts and their
    seconds), PCIe's, and which kernels ran. {} from an engine without `stats().to_dict()`."""
    try:
        snap = engine.stats().to_dict()
    except Exception:  # an older tree's engine, or a backend without the counters
        return {}
    scalars = (int, float, str, bool, type(None))
    return {part: {k: v for k, v in (snap.get(part) or {}).items() if isinstance(v, scalars)}
            for part in ("experts", "pcie", "kernels")}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    threads = spec.get("config", {}).get("cpu_threads")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    result = measure(spec)
    sys.stdout.flush()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    # The tree under test comes first on the path, never this file's own folder's parents.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p) != os.path.dirname(os.path.abspath(__file__))]
    sys.exit(main(sys.argv))
