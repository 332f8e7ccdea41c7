"""Next-layer prefetch inside a captured decode step: the GPU claims free slots for the predicted
experts that still sit in the host store and copies them there itself, over PCIe from mapped memory.

The one-graph decode step (engine/experts/zero_copy.py) reads each miss in place, inside the layer
that needs it, so a step's link time adds to its compute: at bs=1 on the H200 a 48-layer step took
about the resident step's time plus every miss at link speed (RESULTS.md, phase BQ). PDScope (seed
001, §4.4) overlaps the transfer with the layer before: while layer l computes, layer l+1's router
applied to layer l's MoE input names the experts l+1 will mostly pick, and those that are not cached
can be on their way. No host decision fits inside a graph, so both steps run on the device, on a
side stream that layer l+1 joins before it reads its table:

  1. `claim_predicted`: one program marks the predicted experts of the layer (E lanes), ranks those
     whose table entry points outside the pool, hands them the next entries of the list of free
     slots (the same list and counter the in-place misses claim from), points their table entries at
     those slots, and writes a compact copy list and a per-layer log for the host;
  2. `copy_blocks`: (copy, chunk) programs copy each listed block from the store into its slot;
     programs past the list's length return at once (the grid is fixed at capture).

A claimed expert then reads from its slot in layer l+1, and its in-place miss, with the fill on the
way, is not needed. The host admits the claimed slots into the LRU between replays, from the log.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

COPY_CHUNK = 8192  # elements a copy program moves: 16 KB of bf16, one load in flight per program


if triton is not None:

    @triton.jit
    def _claim_predicted_kernel(pred_ptr, n_pred, table_ptr, spares_ptr, counter_ptr, src_ptr, dst_ptr,
                                n_copies_ptr, log_ptr, E, pool_numel, n_spares, BLOCK_E: tl.constexpr):
        e = tl.arange(0, BLOCK_E)
        valid = e < E
        wanted = tl.zeros((BLOCK_E,), tl.int32)
        for j in range(0, n_pred):  # a few dozen predicted (token, choice) pairs at most
            wanted = tl.maximum(wanted, (e == tl.load(pred_ptr + j)).to(tl.int32))
        off = tl.load(table_ptr + e, mask=valid, other=0)
        outside = (wanted > 0) & valid & ((off < 0) | (off >= pool_numel))  # in the store, not a slot
        rank = tl.cumsum(outside.to(tl.int32), 0) - 1  # place among this layer's claims
        first = tl.load(counter_ptr)  # free slots the step has claimed so far
        pos = first + rank
        in_list = outside & (pos < n_spares)
        spare = tl.load(spares_ptr + tl.where(in_list, pos, 0), mask=in_list, other=-1)
        ok = in_list & (spare >= 0)  # the list ends with -1: the claims are a prefix of the ranks
        tl.store(table_ptr + e, spare, mask=ok)
        tl.store(src_ptr + rank, off, mask=ok)
        tl.store(dst_ptr + rank, spare, mask=ok)
        n = tl.sum(ok.to(tl.int32), 0)
        tl.store(n_copies_ptr, n)
        tl.store(counter_ptr, first + n)
        tl.store(log_ptr + e, tl.where(ok, spare, -1), mask=valid)

    @triton.jit
    def _copy_blocks_kernel(pool_ptr, src_ptr, dst_ptr, n_copies_ptr, block_numel, n_chunks, CHUNK: tl.constexpr):
        # A fixed grid of a few programs per multiprocessor walks the (copy, chunk) pieces: when nothing
        # is listed it ends at once, instead of thousands of empty programs competing for the
        # multiprocessors with the main stream's kernels.
        work = tl.load(n_copies_ptr) * n_chunks
        for w in range(tl.program_id(0), work, tl.num_programs(0)):
            c = w // n_chunks
            idx = (w % n_chunks).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
            m = idx < block_numel
            v = tl.load(pool_ptr + tl.load(src_ptr + c) + idx, mask=m)
            tl.store(pool_ptr + tl.load(dst_ptr + c) + idx, v, mask=m)


class PrefetchBuffers:
    """The copy list one prefetch writes and its copy kernel reads: allocated once per ZeroCopyDecode
    (a captured step reuses them every replay; the side stream runs one prefetch at a time)."""

    def __init__(self, max_copies: int, device: torch.device):
        self.src = torch.zeros(max_copies, dtype=torch.int64, device=device)  # (C,) store offsets
        self.dst = torch.zeros(max_copies, dtype=torch.int64, device=device)  # (C,) slot offsets
        self.n_copies = torch.zeros(1, dtype=torch.int32, device=device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self.programs = 4 * sms  # the copy kernel's grid


def prefetch(predicted: torch.Tensor, table: torch.Tensor, spares: torch.Tensor, counter: torch.Tensor,
             log: torch.Tensor, pool: torch.Tensor, buffers: PrefetchBuffers) -> None:
    """predicted (N, k) expert ids of the next layer; table (E,) int64 that layer's offsets (element
    distance from the pool's first element: a slot, or the host store); spares (S,) offsets of free
    slots (-1 past the end) and counter (1,) int32, shared with the in-place claims; log (E,) int64
    receives each claimed slot's offset, -1 elsewhere; pool (slots, P) the cache, each block P
    elements. Device work only (capturable)."""
    E = table.shape[0]
    n_pred = predicted.numel()
    max_copies = min(n_pred, E, buffers.src.shape[0])
    if max_copies == 0:
        return
    _claim_predicted_kernel[(1,)](predicted.contiguous(), n_pred, table, spares, counter, buffers.src, buffers.dst,
                                  buffers.n_copies, log, E, pool.numel(), spares.shape[0],
                                  BLOCK_E=triton.next_power_of_2(E))
    block_numel = pool.shape[1]
    n_chunks = triton.cdiv(block_numel, COPY_CHUNK)
    _copy_blocks_kernel[(min(max_copies * n_chunks, buffers.programs),)](
        pool, buffers.src, buffers.dst, buffers.n_copies, block_numel, n_chunks, CHUNK=COPY_CHUNK)
