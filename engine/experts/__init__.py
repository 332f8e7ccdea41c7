"""Where routed experts live and run: resident, or (later) a host store with a GPU LRU cache."""
