"""Moving KV between the compute device and host memory: streams, events, page-locked buffers, and
the exchange of a decode step's queries and CPU-side results (`HostExchange`).

On CUDA, host→device streaming runs on its own stream (`h2d`), write-backs on another (`d2h`,
the direction decode otherwise leaves idle), and events order them against the compute stream
without host syncs. When the "GPU side" runs on the CPU (`simulate`), the same calls are
synchronous stand-ins, so the hybrid path above them is identical.

Page-locked memory is allocated at its exact size: ordinary host memory registered with
`cudaHostRegister` (the caching host allocator behind `pin_memory=True` rounds every request up
to a power of two and keeps freed blocks pinned).
"""

from __future__ import annotations

import contextlib
import math
import weakref

import torch

from engine.errors import OutOfMemoryError
from engine.kernels.cuda_streams import Switch, indexed

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


class NullEvent:
    """An event that is always complete (simulate mode)."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Transport:
    def __init__(self, device: torch.device):
        self.device = indexed(device)
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None

    def event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.cuda else NullEvent()

    def on(self, stream, back=None):
        """Context that makes `stream` current (no-op without CUDA); `back`, when the caller knows it,
        is the stream made current again on exit, which spares torch.cuda.stream's device checks
        (tens of µs per use on a slow host, and the streaming loop uses it once per chunk)."""
        if not self.cuda:
            return contextlib.nullcontext()
        return Switch(stream, back) if back is not None else torch.cuda.stream(stream)

    def compute_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def wait(self, stream, event) -> None:
        """`stream` waits for `event` on the device; the host does not block."""
        if self.cuda:
            stream.wait_event(event)

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        """`tensor`'s memory must not be reused before `stream`'s queued work that reads it is done."""
        if self.cuda and tensor.is_cuda:
            tensor.record_stream(stream)

    def host(self, shape: tuple, dtype: torch.dtype, pinned: bool) -> HostBuffer:
        return HostBuffer(shape, dtype, pin=pinned and self.cuda)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _cuda_error(code) -> int:
    return int(code.value) if hasattr(code, "value") else int(code)


def _unregister(tensor: torch.Tensor) -> None:
    # Copies that read the buffer may still be queued: finish them before the pages are unlocked.
    try:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    except Exception:  # at interpreter exit CUDA may already be gone; the process unlocks everything
        pass


class HostBuffer:
    """A host tensor of exactly `shape`, page-locked when `pin` (registered, unregistered on release).

    Pageable memory from `torch.empty` is committed page by page as it is first written, so large
    pageable buffers cost only what is used."""

    def __init__(self, shape: tuple, dtype: torch.dtype, pin: bool):
        self.tensor = torch.empty(shape, dtype=dtype)
        self.nbytes = self.tensor.numel() * self.tensor.element_size()
        self.pinned = False
        self._finalizer = None
        if pin and self.nbytes:
            # Portable: page-locked for every CUDA context, whichever thread registers it.
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, HOST_REGISTER_PORTABLE)
            if _cuda_error(err) != 0:
                raise OutOfMemoryError(f"cannot page-lock {self.nbytes / 2**20:.0f} MiB of host memory (CUDA error {err})",
                                       "lower max_context or max_batch, or raise the locked-memory limit (ulimit -l)")
            self.pinned = True
            self._finalizer = weakref.finalize(self, _unregister, self.tensor)

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
            self.pinned = False


class HostExchange:
    """Queries to the host and CPU results back to the device, on CUDA through exact-size page-locked
    buffers (async both ways); in simulate mode the tensors pass as they are.

    The CPU kernel writes its result straight into one of two page-locked result buffers, out and
    LSE side by side, so one copy brings it to the device; the buffer alternates by layer so the
    kernel of layer l+1 never waits for the copy of layer l to have left."""

    def __init__(self, transport: Transport):
        self.tr = transport
        self._q = None  # HostBuffer, flat, in the KV dtype
        self._res = [None, None]  # HostBuffers, flat fp32: out then lse
        self._free = [transport.event(), transport.event()]  # result buffer i has been copied to the device
        self._dev = None  # device flat fp32 the results land in (the merge reads it on the same stream)
        self._turn = 0

    def _flat(self, buf, n: int, dtype: torch.dtype):
        if buf is None or buf.tensor.numel() < n or buf.tensor.dtype != dtype:
            if buf is not None:
                buf.release()
            buf = self.tr.host((max(n, 1 << 16),), dtype, pinned=True)
        return buf

    def to_host(self, q: torch.Tensor, dtype: torch.dtype, stream=None):
        """q (B, nh, T, hs) on the device → (host tensor, event after which it is readable)."""
        if not self.tr.cuda:
            return q.to(dtype), NullEvent()
        self._q = self._flat(self._q, q.numel(), dtype)
        host = self._q.tensor[:q.numel()].view(q.shape)
        host.copy_(q, non_blocking=True)
        ready = self.tr.event()
        ready.record(stream)
        return host, ready

    def result_buffers(self, q_shape: tuple):
        """Worker side: (slot, out (B, nh, T, hs), lse (B, nh, T)) page-locked views for the CPU kernel
        to write, free once the copy that last read them has left; (None, None, None) in simulate mode."""
        if not self.tr.cuda:
            return None, None, None
        i = self._turn
        self._turn ^= 1
        n_out = math.prod(q_shape)
        n = n_out + n_out // q_shape[-1]
        self._free[i].synchronize()  # before the buffer is written, or released to grow
        self._res[i] = self._flat(self._res[i], n, torch.float32)
        flat = self._res[i].tensor
        return i, flat[:n_out].view(q_shape), flat[n_out:n].view(q_shape[:-1])

    def to_device(self, slot, out: torch.Tensor, lse: torch.Tensor, stream=None):
        """Main side: the CPU result → device views (out, lse), by one copy of result buffer `slot`."""
        if not self.tr.cuda:
            return out, lse
        n_out, n = out.numel(), out.numel() + lse.numel()
        if self._dev is None or self._dev.numel() < n:
            self._dev = torch.empty(max(n, 1 << 16), dtype=torch.float32, device=self.tr.device)
        self._dev[:n].copy_(self._res[slot].tensor[:n], non_blocking=True)
        self._free[slot].record(stream)
        return self._dev[:n_out].view(out.shape), self._dev[n_out:n].view(lse.shape)

    def close(self) -> None:
        for buf in (self._q, *self._res):
            if buf is not None:
                buf.release()
        self._q, self._res, self._dev = None, [None, None], None
