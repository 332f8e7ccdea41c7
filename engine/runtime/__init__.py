"""Drives the model: prefill/decode over batches and chat sessions, sampling, templates, counters."""
