"""Scheduling arithmetic: cost models and policies, pure functions of measured costs (no torch)."""
