"""Naming and switching CUDA streams without torch's per-call device lookups.

`torch.cuda.current_stream(device)` for a device without an index, and every `torch.cuda.stream(s)`
context, look the current device up through an NVML-based availability check: 30–50 µs a call on
the H200 host (cProfile of offloaded decode, phase AQ), where the decode path switches streams and
asks for the compute stream several times per layer. A device with its index, and a switch that
knows the stream to go back to, skip those lookups.
"""

from __future__ import annotations

import torch


def indexed(device) -> torch.device:
    """`device` with its index filled in for CUDA (the current device when it had none)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Switch:
    """Make stream `to` current, then `back` again (the caller knows `back`: no device lookup)."""

    __slots__ = ("to", "back")

    def __init__(self, to, back):
        self.to, self.back = to, back

    def __enter__(self):
        torch.cuda.set_stream(self.to)

    def __exit__(self, *exc):
        torch.cuda.set_stream(self.back)
