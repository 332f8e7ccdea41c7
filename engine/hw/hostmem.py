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


PAGE = 4096


def touched(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A page-aligned host tensor of nbytes whose pages are committed (written once), so timing never
    counts first-touch page faults. Its pages hold nothing else, so registering it can never
    overlap another registration (cudaHostRegister refuses a page registered twice)."""
    item = torch.empty((), dtype=dtype).element_size()
    span = -(-nbytes // PAGE) * PAGE  # whole pages
    raw = torch.empty(span + PAGE, dtype=torch.uint8)  # one page of slack to align the start
    start = (-raw.data_ptr()) % PAGE
    t = raw[start:start + nbytes - nbytes % item].view(dtype)  # keeps raw's storage alive
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


def device_address(t: torch.Tensor) -> int:
    """The address a CUDA kernel reads t's first element at: t lies in registered (page-locked,
    mapped) host memory. Under unified addressing this is nearly always the host address; the driver
    says so (cuMemHostGetDevicePointer) rather than us assuming it. Raises RuntimeError when t is
    not registered host memory."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"the CUDA driver library cannot be loaded ({e})") from e
    ptr = ctypes.c_uint64(0)
    fn = cuda.cuMemHostGetDevicePointer_v2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    err = int(fn(ctypes.byref(ptr), ctypes.c_void_p(t.data_ptr()), 0))
    if err != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed with CUDA driver error {err}: not mapped host memory")
    return int(ptr.value)
