"""Naming and switching CUDA streams without torch's per-call device lookups.

`torch.cuda.current_stream(device)` for a device without an index, and every `torch.cuda.stream(s)`
context, look the current device up through an NVML-based availability check: 30–50 µs a call on
a server host, where the decode path switches streams and
asks for the compute stream several times per layer. A device with its index, and a switch that
knows the stream to go back to, skip those lookups. Small host tensors reach the GPU without
making the host wait for the stream (`to_device_async`).
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


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`, queued without waiting. A copy from pageable memory to a GPU
    blocks the host until the stream has run everything queued before it: at decode that is the
    whole step just launched (~8 ms a token of host time at 2K bs=1 for the sampler's copies), and
    the next step could not be queued behind it. From pinned memory the copy is queued and the host goes on."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
