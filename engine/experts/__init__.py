"""Where routed experts live and run: resident, or offloaded (a host store, a GPU LRU slot cache, a
per-layer fill/CPU split, lookahead prefetch: offload.OffloadedExperts)."""
