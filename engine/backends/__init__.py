"""Other engines behind Tandem's interface: llama.cpp (GGUF on CPU-only machines; the benchmark peer)."""
