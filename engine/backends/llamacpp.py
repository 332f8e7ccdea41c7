"""llama.cpp through llama-cpp-python: the peer in benchmarks, run on the same GGUF file.

Only what a fair comparison needs for now: load a GGUF with a thread count and context size, and
decode greedily from token ids, timing every token.
"""

from __future__ import annotations

import time
from pathlib import Path

from engine.errors import ConfigError


class LlamaCpp:
    def __init__(self, gguf_path: str | Path, n_threads: int, n_ctx: int = 2048):
        try:
            import llama_cpp
        except ImportError as e:
            raise ConfigError("llama-cpp-python is not installed",
                              "pip install llama-cpp-python (it builds llama.cpp from source, ~5 min)") from e
        self.version = llama_cpp.__version__
        self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_threads=n_threads, n_threads_batch=n_threads,
                                   n_ctx=n_ctx, n_gpu_layers=0, verbose=False)

    def timed_greedy(self, prompt_ids: list[int], n_new: int) -> tuple[list[int], list[float]]:
        """Greedy decode of exactly n_new tokens (EOS ignored); returns tokens and the perf_counter
        time at which each one was available."""
        self.llm.reset()
        tokens, stamps = [], []
        for tok in self.llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
            tokens.append(tok)
            stamps.append(time.perf_counter())
            if len(tokens) == n_new:
                break
        return tokens, stamps

    def close(self) -> None:
        self.llm.close()
