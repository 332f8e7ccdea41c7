"""The write-back staging ring: where a step's CPU-bound KV lands on the host before the CPU side's
thread lays it out per head in the unpinned region.

A D2H copy into pageable memory is synchronous and slow (~7 GB/s), so CPU-bound tokens leave the
device into page-locked memory first: R layer slots of S tokens each, (R, S, 2, n_kv, hs). Layer l
uses slot l % R; before its copies, `wait_slot` makes sure the CPU side's thread has finished laying
out layer l − R, which used the slot last. So page-locked staging is R layers' worth, not n_layers'.
"""

from __future__ import annotations

import torch

from engine.errors import OutOfMemoryError

# Layers of CPU-bound tokens the ring holds at once: the D2H of layer l waits (on the host, rarely)
# until the CPU side's thread has laid out layer l − R. Four keep that wait rare while a 32K prefill
# of a 48-layer model stages 256 MiB instead of the 3 GiB of every layer.
STAGING_LAYERS = 4


class StagingRing:
    def __init__(self, transport, n_layers: int, n_kv: int, head_dim: int, dtype: torch.dtype):
        self.transport, self.n_layers, self.n_kv, self.head_dim, self.dtype = transport, n_layers, n_kv, head_dim, dtype
        self.buffer = None  # HostBuffer (R, S, 2, n_kv, hs)
        self.jobs: dict = {}  # slot → Future of the layout into the unpinned region that reads it

    def slots(self, n_tokens: int, floor_tokens: int) -> torch.Tensor:
        """The ring (R, S, 2, n_kv, hs) with S ≥ n_tokens. A new buffer is sized for floor_tokens
        at least (the caller passes all of the step's placed tokens, not only its CPU share):
        page-locking costs ~0.5 s per GB, and a later step of the same size with a larger share must
        not pay it again (a 32K step of a 2 KiB/token layer: 64 MiB per slot)."""
        if self.buffer is None or self.buffer.tensor.shape[1] < n_tokens:
            self.wait_all()
            if self.buffer is not None:
                self.buffer.release()
            shape = (min(self.n_layers, STAGING_LAYERS), max(n_tokens, floor_tokens), 2, self.n_kv, self.head_dim)
            try:
                self.buffer = self.transport.host(shape, self.dtype, pinned=True)
            except OutOfMemoryError:  # the host refuses page-locked memory: pageable staging, synchronous copies
                self.buffer = self.transport.host(shape, self.dtype, pinned=False)
        return self.buffer.tensor

    def slot(self, layer: int) -> int:
        return layer % self.buffer.tensor.shape[0]

    def wait_slot(self, slot: int) -> None:
        """Until the layout that last read `slot` is done."""
        job = self.jobs.pop(slot, None)
        if job is not None:
            job.result()

    def wait_all(self) -> None:
        for slot in list(self.jobs):
            self.wait_slot(slot)

    @property
    def pinned_bytes(self) -> int:
        return self.buffer.nbytes if self.buffer is not None and self.buffer.pinned else 0

    def close(self) -> None:
        self.wait_all()
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None
