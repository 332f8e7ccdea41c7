"""Decode speed on the CPU when another program keeps a core busy, Tandem beside llama.cpp.

    python3 -m engine.bench.busy_core [--model FILE] [--rounds N] [--json out.json]

A desktop's cores are rarely all free. Three systems run with their default thread count, first on
the idle machine, then with a process spinning on core 0 (pinned there), taking turns, the order
reversed every other round: Tandem; llama.cpp as its own programs run it (every core, fixed); and
llama.cpp inside Tandem (`backend llamacpp`, what `auto` picks for a GGUF on a CPU-only machine),
whose decode steps measure their thread count as Tandem's do. Each round generates NEW_TOKENS tokens after the
README's question (greedy, EOS ignored) and reports the engine's decode tok/s (prefill excluded).
Tandem's rounds continue one engine, as a chat would: its thread count is measured by decode steps
(engine/runtime/thread_chooser.py), so its first busy round includes finding the busy core.
Linux only (the spinning process is pinned with sched_setaffinity).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from statistics import median

NEW_TOKENS = 48
SPIN = "import os; os.sched_setaffinity(0, {0}); exec('while True: pass')"


def main(model: str, rounds: int) -> dict:
    from engine.api import Engine, EngineConfig, GenerationRequest

    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs Linux and at least two usable cores")
    cores = len(os.sched_getaffinity(0))
    systems = {"tandem": dict(backend="tandem"), "llamacpp": dict(backend="llamacpp", cpu_threads=cores),
               "tandem llamacpp backend": dict(backend="llamacpp")}
    engines = {name: Engine(EngineConfig(model=model, device="cpu", max_context=2048, max_batch=1, **config))
               for name, config in systems.items()}
    request = GenerationRequest(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                max_new_tokens=NEW_TOKENS, greedy=True, ignore_eos=True)
    for engine in engines.values():
        engine.generate(request)  # warm-up
    figures: dict[str, dict[str, list[float]]] = {}
    try:
        for condition in ("idle", "busy core 0"):
            spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if condition != "idle" else None
            try:
                runs = figures[condition] = {name: [] for name in engines}
                for r in range(rounds):
                    order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
                    for name, engine in order:
                        runs[name].append(round(engine.generate(request).decode_tok_s, 1))
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
        chosen = {name: {k: v for k, v in engines[name].info().items() if k.startswith("cpu_thread")}
                  for name in ("tandem", "tandem llamacpp backend")}
    finally:
        for engine in engines.values():
            engine.close()
    result = {c: {n: {"median": median(v), "rounds": v} for n, v in runs.items()} for c, runs in figures.items()}
    for condition, runs in result.items():
        print(f"{condition:12s} decode tok/s  " + "  ".join(f"{n} {r['median']:.1f}" for n, r in runs.items())
              + f"  Tandem / llama.cpp {runs['tandem']['median'] / runs['llamacpp']['median']:.2f}")
    return {"decode_tok_s": result, "threads_chosen": chosen}


if __name__ == "__main__":
    args = sys.argv[1:]

    def option(name: str, default):
        if name in args:
            i = args.index(name)
            value = args[i + 1]
            del args[i:i + 2]
            return value
        return default

    out, model, rounds = option("--json", None), option("--model", "builtin:smollm2-135m"), int(option("--rounds", 5))
    figures = main(model, rounds)
    if out:
        from engine.bench.common import header

        record = {**header(), "bench": "busy_core", "model": model, "rounds": rounds, "new_tokens": NEW_TOKENS,
                  "command": "python3 -m engine.bench.busy_core " + " ".join(sys.argv[1:]), **figures}
        with open(out, "w") as f:
            json.dump(record, f, indent=2)
