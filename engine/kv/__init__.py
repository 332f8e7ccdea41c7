"""KV cache placement and the attention over it: resident (all on one device) and, later, the
InplaceKVCache/WriteScope hybrid. Models talk to whichever is built through `KVBackend`."""
