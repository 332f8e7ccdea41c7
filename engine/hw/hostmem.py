"""Exact-size page-locked host memory: ordinary tensors registered with cudaHostRegister.

`torch.empty(pin_memory=True)` goes through the caching host allocator, which rounds each block up
to a power of two and keeps freed blocks cached; registering ordinary memory pins exactly the bytes
asked for and is what the KV and expert regions use. The memory must stay alive and registered
until every copy reading it has finished; `registered()` unregisters on exit after a device sync.
"""

from __future__ import annotations

import contextlib

import torch


def register(t: torch.Tensor) -> None:
    """Page-lock t's storage (contiguous, on the host) in place."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("only a contiguous host tensor can be registered")
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister failed with CUDA error {err} for {t.numel() * t.element_size()} bytes")


def unregister(t: torch.Tensor) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))
    if err != 0:
        raise RuntimeError(f"cudaHostUnregister failed with CUDA error {err}")


def touched(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A host tensor of nbytes whose pages are committed (written once), so timing never counts
    first-touch page faults."""
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    t = torch.empty(n, dtype=dtype)
    t.view(torch.uint8).fill_(1)
    return t


@contextlib.contextmanager
def registered(t: torch.Tensor):
    """Pin t for the duration of the block (the device is synchronised before unpinning)."""
    register(t)
    try:
        yield t
    finally:
        torch.cuda.synchronize()
        unregister(t)
