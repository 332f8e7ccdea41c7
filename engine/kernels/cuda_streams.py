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


# -- stream work through the CUDA driver (captured into a graph like any other stream work) ----------
_driver = None


def _cuda_driver():
    global _driver
    if _driver is None:
        import ctypes

        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"the CUDA driver library cannot be loaded ({e})") from e
        lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        _driver = lib
    return _driver


def _checked(err: int, what: str) -> None:
    if int(err) != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {int(err)}")


def launch_host_func(stream: torch.cuda.Stream, fn: int, data: int) -> None:
    """Queue a call fn(data) of a C function (CUhostFn) on `stream`; during a capture it becomes a
    host node of the graph. fn must not call CUDA (the driver's rule for host functions)."""
    _checked(_cuda_driver().cuLaunchHostFunc(stream.cuda_stream, fn, data), "cuLaunchHostFunc")


def copy_async(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Copy src into dst (same bytes, both contiguous; host ones page-locked) in `stream`'s order,
    straight through the driver: torch's copy_ from pinned memory also records an event for its host
    allocator, which a graph capture does not need."""
    n = src.numel() * src.element_size()
    assert dst.is_contiguous() and src.is_contiguous() and dst.numel() * dst.element_size() == n
    _checked(_cuda_driver().cuMemcpyAsync(dst.data_ptr(), src.data_ptr(), n, stream.cuda_stream), "cuMemcpyAsync")
