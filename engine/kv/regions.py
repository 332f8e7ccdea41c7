"""Fixed-size KV blocks: the unit of allocation, cropping and (in the hybrid cache) routing."""

from __future__ import annotations

import heapq
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.errors import OutOfMemoryError


class BlockAllocator:
    """A free list over `n_blocks` block ids; allocation never touches tensor memory."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def n_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfMemoryError(
                f"the KV cache is full ({self.n_blocks} blocks in use)",
                "end or shorten a chat, lower max_batch, or raise max_context",
            )
        return self._free.pop()

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class SequenceBlocks:
    """One sequence's block table: token p lives in blocks[p // block_size] at p % block_size."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.blocks: list[int] = []
        self.length = 0

    def ensure(self, n_tokens: int, allocator: BlockAllocator) -> None:
        while len(self.blocks) * self.block_size < n_tokens:
            self.blocks.append(allocator.allocate())

    def crop(self, n_tokens: int, allocator: BlockAllocator) -> None:
        keep = -(-n_tokens // self.block_size)  # ceil
        allocator.release(self.blocks[keep:])
        del self.blocks[keep:]
        self.length = min(self.length, n_tokens)

    def slots(self, start: int, stop: int) -> torch.Tensor:
        """Flat slot index (block · block_size + offset) of positions start..stop-1, int64 (stop-start,)."""
        bs = self.block_size
        first, last = start // bs, -(-stop // bs)
        table = torch.tensor(self.blocks[first:last], dtype=torch.int64)  # (n_blocks,)
        flat = (table[:, None] * bs + torch.arange(bs)).flatten()  # (n_blocks · bs,)
        return flat[start - first * bs : stop - first * bs]


# -- the host regions of the InplaceKVCache (seed 000, §4) ----------------------------------------
#
# Host regions are made of extents: E tokens (a whole number of blocks) of every layer, handed to
# one sequence at a time and filled front to back. A sequence's tokens in a region are therefore a
# few long runs, which is what both engines want: the CPU kernel reads a run as one strided view,
# and one extent-layer of the pinned region is one contiguous DMA into a ping-pong buffer.


class ExtentPool:
    """Ids 0..n_extents-1 of one region's extents; the lowest free id first, so runs stay adjacent."""

    def __init__(self, n_extents: int):
        self.n_extents = n_extents
        self._free = list(range(n_extents))  # a heap

    @property
    def n_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return heapq.heappop(self._free) if self._free else None

    def release(self, ids: list[int]) -> None:
        for i in ids:
            heapq.heappush(self._free, i)


class UnpinnedRegion:
    """The CPU compute region: pageable host memory in per-head layout.

    layers[l] (2, n_kv, n_extents·E, hs): K and V of layer l as n_kv head rows; extent e holds
    tokens [e·E, (e+1)·E) of every row. A run of tokens is a (n_kv, t, hs) view that the CPU kernel
    walks in place. Pages are committed when first written, so the capacity is virtual; one tensor
    per layer keeps each reservation modest for the kernel's overcommit check.
    """

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, extent_tokens: int, n_extents: int,
                 dtype: torch.dtype):
        self.E = extent_tokens
        shape = (2, n_kv, n_extents * extent_tokens, head_dim)
        try:
            self.layers = [torch.empty(shape, dtype=dtype) for _ in range(n_layers)]
        except RuntimeError as e:
            raise OutOfMemoryError(f"cannot reserve {n_layers * math.prod(shape) * dtype.itemsize / 2**30:.1f} GiB "
                                   f"of address space for the host KV ({e})", "lower max_context or max_batch") from e
        self.pool = ExtentPool(n_extents)
        self.extent_bytes = n_layers * 2 * n_kv * extent_tokens * head_dim * dtype.itemsize

    def allocate(self) -> int | None:
        return self.pool.allocate()

    def release(self, ids: list[int]) -> None:
        self.pool.release(ids)

    def views(self, layer: int, ranges: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zero-copy (k, v) views, each (n_kv, stop − start, hs), of arena token ranges."""
        kv = self.layers[layer]
        return [(kv[0, :, a:b], kv[1, :, a:b]) for a, b in ranges]

    def write(self, layer: int, start: int, src: torch.Tensor) -> None:
        """src (n, 2, n_kv, hs) host, token-interleaved → layer's arena tokens [start, start+n)."""
        n = src.shape[0]
        self.layers[layer][:, :, start:start + n].copy_(src.permute(1, 2, 0, 3))  # (2, n_kv, n, hs)

    @property
    def bytes_in_use(self) -> int:
        return (self.pool.n_extents - self.pool.n_free) * self.extent_bytes


class PinnedRegion:
    """The load region: page-locked host extents, each one allocation (n_layers, E, 2, n_kv, hs).

    A layer's tokens of an extent are one contiguous range (K and V interleaved per token), so the
    extent-layer is one full-bandwidth DMA into a ping-pong buffer. Extents are pinned once, kept
    for reuse when freed, and the next one is prepared ahead of need (`reserve_ahead`) so pinning
    stays off the decode path; on CUDA that runs on a background thread.
    """

    def __init__(self, transport, n_layers: int, n_kv: int, head_dim: int, extent_tokens: int,
                 max_extents: int, dtype: torch.dtype, cap_bytes: int | None):
        self.transport = transport
        self.E = extent_tokens
        self.shape = (n_layers, extent_tokens, 2, n_kv, head_dim)
        self.extent_bytes = math.prod(self.shape) * torch.empty((), dtype=dtype).element_size()
        self.dtype = dtype
        limit = max_extents if cap_bytes is None else min(max_extents, cap_bytes // self.extent_bytes)
        self.max_extents = int(limit)
        self.buffers: list = []  # HostBuffer per extent id
        self._free: list[int] = []  # a heap of pinned, unused extents
        self._lock = threading.Lock()
        self._ahead = None  # Future of a background allocation
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-pin") if transport.cuda else None

    def _grow(self) -> int | None:
        with self._lock:
            if len(self.buffers) >= self.max_extents:
                return None
            self.buffers.append(None)
            ext = len(self.buffers) - 1
        try:
            buf = self.transport.host(self.shape, self.dtype, pinned=True)
        except Exception:
            with self._lock:
                self.max_extents = ext  # the host refuses more: stop growing, route to the CPU instead
                self.buffers.pop()
            return None
        with self._lock:
            self.buffers[ext] = buf
            heapq.heappush(self._free, ext)
        return ext

    def allocate(self) -> int | None:
        """A pinned extent for a sequence, or None when the region is at its cap."""
        if self._ahead is not None:
            self._ahead.result()
            self._ahead = None
        with self._lock:
            if self._free:
                return heapq.heappop(self._free)
        if self._grow() is None:
            return None
        with self._lock:
            return heapq.heappop(self._free)

    def release(self, ids: list[int]) -> None:
        with self._lock:
            for i in ids:
                heapq.heappush(self._free, i)

    def reserve_ahead(self) -> None:
        """Have one free extent ready before it is needed."""
        with self._lock:
            if self._free or len(self.buffers) >= self.max_extents or self._ahead is not None:
                return
        if self._pool is None:
            self._grow()
        else:
            self._ahead = self._pool.submit(self._grow)

    def slab(self, layer: int, ext: int, start: int, n: int) -> torch.Tensor:
        """(n, 2, n_kv, hs) contiguous: tokens [start, start+n) of one layer of an extent."""
        return self.buffers[ext].tensor[layer, start:start + n]

    @property
    def bytes_pinned(self) -> int:
        return sum(b.nbytes for b in self.buffers if b is not None)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.result()
        for b in self.buffers:
            if b is not None:
                b.release()
        self.buffers, self._free = [], []
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class RegionRun:
    """One sequence's tokens in one host region: its extents in order, filled front to back, and
    the positions they hold (segments in placement order, so positions only grow along the run)."""

    def __init__(self, extent_tokens: int):
        self.E = extent_tokens
        self.extents: list[int] = []
        self.fill = 0  # tokens held
        self.segments: list[list[int]] = []  # [first position, count]

    def reserve(self, n: int, first_pos: int, region) -> list[tuple[int, int, int]] | None:
        """Room for n tokens at positions first_pos…: pieces (extent, offset in extent, count).
        None, with nothing changed, when the region runs out of extents."""
        need = -(-(self.fill + n) // self.E) - len(self.extents)
        new = []
        for _ in range(max(0, need)):
            ext = region.allocate()
            if ext is None:
                region.release(new)
                return None
            new.append(ext)
        self.extents.extend(new)
        pieces, at, left = [], self.fill, n
        while left:
            i, off = divmod(at, self.E)
            take = min(left, self.E - off)
            pieces.append((self.extents[i], off, take))
            at += take
            left -= take
        self.fill += n
        if self.segments and sum(self.segments[-1]) == first_pos:
            self.segments[-1][1] += n
        else:
            self.segments.append([first_pos, n])
        return pieces

    def extent_fills(self) -> list[tuple[int, int]]:
        """(extent, tokens in it) for every extent holding tokens, in order."""
        out, left = [], self.fill
        for ext in self.extents:
            if left <= 0:
                break
            out.append((ext, min(left, self.E)))
            left -= self.E
        return out

    def arena_ranges(self) -> list[tuple[int, int]]:
        """Token ranges [start, stop) of the region's arena, adjacent extents merged."""
        ranges: list[tuple[int, int]] = []
        for ext, n in self.extent_fills():
            start = ext * self.E
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], start + n)
            else:
                ranges.append((start, start + n))
        return ranges

    def crop(self, n_positions: int) -> list[int]:
        """Keep the tokens at positions < n_positions; returns the extents no longer needed."""
        keep, segments = 0, []
        for first, count in self.segments:
            c = min(count, max(0, n_positions - first))
            if c:
                segments.append([first, c])
                keep += c
        self.segments, self.fill = segments, keep
        n_ext = -(-keep // self.E)
        freed = self.extents[n_ext:]
        del self.extents[n_ext:]
        return freed

    def release_all(self) -> list[int]:
        freed, self.extents, self.fill, self.segments = self.extents, [], 0, []
        return freed
