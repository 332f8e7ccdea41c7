"""Decode CPU time per token of the built-in model, one thread per system, systems taking turns.

    python3 -m engine.bench.cpu_time                      # Tandem float32, Tandem blocks, llama.cpp
    python3 -m engine.bench.cpu_time "llama.cpp" "tandem blocks"
    python3 -m engine.bench.cpu_time --json out.json      # the record, with the machine's header
    python3 -m engine.bench.cpu_time --model x.gguf       # another GGUF than the built-in model's

For a shared machine where wall-clock speeds say nothing: the process's CPU time (which a
descheduled process does not accrue) over `generate` of 40 tokens minus that of 8, divided by the 32
tokens between, the README's question, greedy, EOS ignored; one thread each, so no thread team waits
on a descheduled member. The first of 4 rounds warms up; the median of the other 3 is printed.
"""

from __future__ import annotations

import sys
import time
from statistics import median

SYSTEMS = {
    "tandem float32": {"backend": "tandem", "dtype": "float32"},  # the dequantised reference path
    "tandem blocks": {"backend": "tandem"},  # dtype auto on a CPU: GGUF blocks kept (engine/quant)
    "llama.cpp": {"backend": "llamacpp"},
}
SHORT, LONG, ROUNDS = 8, 40, 4


def main(names: list[str], model: str = "builtin:smollm2-135m") -> dict[str, float]:
    import torch

    from engine.api import Engine, EngineConfig, GenerationRequest

    torch.set_num_threads(1)
    engines = {n: Engine(EngineConfig(model=model, device="cpu", cpu_threads=1, **SYSTEMS[n]))
               for n in names}

    def request(n: int) -> GenerationRequest:
        return GenerationRequest(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                 max_new_tokens=n, greedy=True, ignore_eos=True)

    samples: dict[str, list[float]] = {n: [] for n in engines}
    for r in range(ROUNDS):
        order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
        for name, engine in order:
            c0 = time.process_time()
            engine.generate(request(SHORT))
            c1 = time.process_time()
            engine.generate(request(LONG))
            c2 = time.process_time()
            if r:
                samples[name].append(((c2 - c1) - (c1 - c0)) / (LONG - SHORT) * 1e3)
    for engine in engines.values():
        engine.close()
    result = {n: round(median(v), 2) for n, v in samples.items()}
    for n, v in samples.items():
        print(f"{n:16s} decode CPU ms/token, 1 thread: {result[n]:6.2f}  (rounds {[round(x, 2) for x in v]})")
    return result


if __name__ == "__main__":
    args = sys.argv[1:]
    out, model = None, "builtin:smollm2-135m"
    if "--json" in args:
        i = args.index("--json")
        out, args = args[i + 1], args[:i] + args[i + 2:]
    if "--model" in args:
        i = args.index("--model")
        model, args = args[i + 1], args[:i] + args[i + 2:]
    figures = main(args or list(SYSTEMS), model)
    if out:
        import json
        import os

        from engine.bench.common import header

        record = {**header(), "bench": "cpu_time", "model": model, "load_average_after": os.getloadavg()[0],
                  "command": "python3 -m engine.bench.cpu_time " + " ".join(sys.argv[1:]),
                  "decode_cpu_ms_per_token": figures, "threads": 1, "tokens": LONG - SHORT}
        with open(out, "w") as f:
            json.dump(record, f, indent=2)
