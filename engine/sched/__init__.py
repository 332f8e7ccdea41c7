"""Scheduling arithmetic: the roofline share of the KV cache and the cost models (no torch)."""
