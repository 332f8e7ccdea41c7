"""Exact-size page-locked host memory: ordinary tensors registered with cudaHostRegister.

`torch.empty(pin_memory=True)` goes through the caching host allocator, which rounds each block up
to a power of two and keeps freed blocks cached; registering ordinary memory pins exactly the bytes
asked for and is what the KV and expert regions use. The memory must stay alive and registered
until every copy reading it has finished; `registered()` unregisters on exit after a device sync.
"""

from __future__ import annotations

import contextlib
import math
import mmap

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
HUGE_PAGE = 2 << 20  # x86-64 transparent huge page, bytes


def huge_page_advice() -> bool:
    """Whether large host regions ask Linux for transparent huge pages: wherever it has them (they
    never read slower than 4 KiB pages for the streamed expert store, and faster where TLB misses bind)."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def large_host_tensor(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor for a large region the CPU streams through (the expert store),
    backed by 2 MiB transparent huge pages where Linux has them.

    On 4 KiB pages each 4 KiB row of a streamed bf16 expert is a new TLB entry. On huge pages the
    native expert kernel reads 5-15% more GB/s from DRAM at 1 token where TLB misses bind, and no
    less where they do not. Elsewhere (no MADV_HUGEPAGE, a region under one huge page) this is
    torch.empty. Pages are committed as they are first written, as with torch.empty; the mapping lives
    as long as the tensor (and whatever keeps it alive: a registration's finalizer)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not huge_page_advice():
        return torch.empty(shape, dtype=dtype)
    # Private: an anonymous shared mapping (mmap's default) is shmem, which THP leaves alone. One huge
    # page of slack to align the start.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping
    start = (-raw.data_ptr()) % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:  # THP disabled ("never") or not built in: ordinary pages, same memory
        pass
    return raw[start:start + nbytes].view(dtype).view(shape)


def mapping_fields(t: torch.Tensor) -> dict[str, str] | None:
    """The /proc/self/smaps fields (name → value text) of the mapping holding t's first byte; None
    where smaps cannot say (not Linux)."""
    address = t.data_ptr()
    fields: dict[str, str] | None = None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head, _, rest = line.partition(" ")
                if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                    if fields is not None:
                        return fields
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    fields = {} if lo <= address < hi else None
                elif fields is not None:
                    fields[head.rstrip(":")] = rest.strip()
    except OSError:
        return None
    return fields


def huge_page_eligible(t: torch.Tensor) -> bool | None:
    """Whether Linux may back t's memory with transparent huge pages (its mapping is advised and THP
    is on: smaps' THPeligible); None where smaps cannot say."""
    fields = mapping_fields(t)
    return None if fields is None or "THPeligible" not in fields else fields["THPeligible"] == "1"


def huge_page_bytes(t: torch.Tensor) -> int | None:
    """Bytes of t's mapping that sit on transparent huge pages now (smaps' AnonHugePages)."""
    fields = mapping_fields(t)
    if fields is None or "AnonHugePages" not in fields:
        return None
    return int(fields["AnonHugePages"].split()[0]) * 1024


def touched(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A page-aligned host tensor of nbytes whose pages are committed (written once), so timing never
    counts first-touch page faults; from 2 MiB on, on huge pages like the expert store's
    (large_host_tensor). Its pages hold nothing else, so registering it can never
    overlap another registration (cudaHostRegister refuses a page registered twice)."""
    item = torch.empty((), dtype=dtype).element_size()
    if nbytes >= HUGE_PAGE and huge_page_advice():  # as the engine's expert store holds its blocks
        t = large_host_tensor((nbytes // item,), dtype)
    else:
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
