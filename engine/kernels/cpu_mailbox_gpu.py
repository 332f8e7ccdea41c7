"""The device's side of the CPU mailbox: a captured kernel hands part of a layer's misses to the CPU.

Inside the one decode graph (engine/experts/zero_copy.py) a miss not sent to the CPU is read over
PCIe: at 32K with one chat that alone binds the step to the link (~130 misses a step at ~35 GB/s of
in-place reads over PCIe Gen5). Seed 004 splits a layer's misses between the link and the
CPU, computing in place from host DRAM. Here the split is made on the device, per layer, with no host
call between layers:

  1. `post` (one program): of the layer's m missed experts (their table entry points outside the slot
     pool), the first c in pair order go to the CPU, c the integer that makes the layer's later side
     soonest done: max((m − c) · link_ms, c · cpu_ms + handoff_ms), the three costs (ms) read from
     `split` (engine/experts/cpu_mailbox.py's MissSplit sets them from the cost model and the worker's
     measured rate). Ties go to the link: a miss read over PCIe fills a slot on the way, a CPU expert
     never enters the cache. The CPU's pairs get id -1 for the GPU kernels (computed nowhere on the
     GPU, no slot claimed). The layer's routing, the marks, the routing weights and x are written to
     the mailbox in pinned host memory; then, after a system-wide fence, the post's sequence number.
     A layer without CPU pairs posts nothing.
  2. The native worker (native/cpu_mailbox.h) sees the number, computes the marked experts with the
     CPU kernels and writes their weighted sum, then its own copy of the number.
  3. The layer's sum kernel (moe_decode_gpu, `cpu=`) waits for that number and adds the CPU's sum.

The wait is bounded (max_polls reads of host memory): a worker that never answers costs a wrong
step flagged in `error` (read by the host with the step's logs), never a hung GPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _post_kernel(x_ptr, ids_ptr, wts_ptr, offs_ptr, gpu_ids_ptr, log_ptr, cpu_log_ptr, split_ptr, seq_ptr,
                     expect_ptr, box_ptr, box_ids_ptr, box_cpu_ptr, box_w_ptr, box_x_ptr, layer, P, top_k, NH, E,
                     pool_numel, SYS_FENCE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_X: tl.constexpr):
        q = tl.arange(0, BLOCK_P)  # (token, choice) pairs
        in_p = q < P
        ids = tl.load(ids_ptr + q, mask=in_p, other=-1).to(tl.int64)
        valid = in_p & (ids >= 0) & (ids < E)
        off = tl.load(offs_ptr + tl.where(valid, ids, 0), mask=valid, other=0)
        outside = valid & ((off < 0) | (off >= pool_numel))  # a miss: read from the host store
        same = (ids[:, None] == ids[None, :]) & in_p[None, :]  # (P, P) pair q and pair q' route one expert
        earlier = q[None, :] < q[:, None]
        first = outside & (tl.sum((same & earlier).to(tl.int32), 1) == 0)  # a missed expert's first pair
        m = tl.sum(first.to(tl.int32), 0).to(tl.float32)  # missed experts
        link_ms, cpu_ms, handoff_ms = tl.load(split_ptr), tl.load(split_ptr + 1), tl.load(split_ptr + 2)
        # Both sides' times are linear in c, so the best integer c is next to where they cross (or 0, which
        # saves the hand-off): the smallest span of c = 0, floor and ceil of the crossing
        cross = tl.minimum(tl.maximum((m * link_ms - handoff_ms) / (link_ms + cpu_ms), 0.0), m)
        lo = tl.floor(cross)
        hi = tl.minimum(lo + 1.0, m)
        span0 = m * link_ms
        span_lo = tl.maximum((m - lo) * link_ms, lo * cpu_ms + handoff_ms)
        span_hi = tl.maximum((m - hi) * link_ms, hi * cpu_ms + handoff_ms)
        quota = tl.where(span_hi < span_lo, hi, lo)
        quota = tl.where(tl.minimum(span_lo, span_hi) < span0, quota, 0.0).to(tl.int32)
        rank = tl.cumsum(first.to(tl.int32), 0) - 1  # a first pair's place among the missed experts
        to_cpu = first & (rank < quota)
        cpu = outside & (tl.sum((same & to_cpu[None, :]).to(tl.int32), 1) > 0)  # every pair of those experts
        tl.store(gpu_ids_ptr + q, tl.where(cpu, -1, ids), mask=in_p)
        tl.store(log_ptr + q, ids, mask=in_p)
        tl.store(cpu_log_ptr + q, cpu.to(tl.int64), mask=in_p)
        if tl.sum(cpu.to(tl.int32), 0) > 0:
            seq = tl.load(seq_ptr) + 1
            tl.store(box_ids_ptr + q, ids, mask=in_p)
            tl.store(box_cpu_ptr + q, cpu.to(tl.int64), mask=in_p)
            tl.store(box_w_ptr + q, tl.load(wts_ptr + q, mask=in_p, other=0.0).to(tl.float32), mask=in_p)
            for i0 in range(0, NH, BLOCK_X):  # x (N, H), contiguous
                i = i0 + tl.arange(0, BLOCK_X)
                tl.store(box_x_ptr + i, tl.load(x_ptr + i, mask=i < NH), mask=i < NH)
            tl.store(box_ptr + 8, layer)
            tl.store(box_ptr + 9, P // top_k)
            if SYS_FENCE:  # every thread's writes reach host memory before any thread writes the number
                tl.inline_asm_elementwise("fence.sc.sys;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                          pack=1)
            tl.debug_barrier()
            tl.store(box_ptr, seq)  # the post
            if SYS_FENCE:
                tl.inline_asm_elementwise("fence.sc.sys;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                          pack=1)
            tl.store(seq_ptr, seq)
            tl.store(expect_ptr, seq)
        else:
            tl.store(expect_ptr, 0)


def post(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, pool_numel: int,
         layer: int, box, gpu_ids: torch.Tensor, log: torch.Tensor, cpu_log: torch.Tensor) -> torch.Tensor:
    """x (N, H); ids, weights (N, k); offsets (E,) the layer's table. box: the mailbox's device-side
    tensors (engine/experts/cpu_mailbox.py: split, seq, expect, to_cpu and its views). Writes gpu_ids
    (N·k,) int64, the ids the GPU kernels take (-1 for the CPU's pairs), log (N·k,) the routing and
    cpu_log (N·k,) 1 for the CPU's pairs → gpu_ids viewed (N, k)."""
    N, k = ids.shape
    P = N * k
    assert N <= box.max_rows and x.shape[1] == box.hidden, "the mailbox holds max_rows rows of hidden"
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    _post_kernel[(1,)](x, ids, weights, offsets, gpu_ids, log, cpu_log, box.split, box.seq, box.expect,
                       box.to_cpu, box.ids, box.marks, box.weights, box.x, layer, P, k, N * box.hidden,
                       offsets.shape[0], pool_numel, SYS_FENCE=x.is_cuda,
                       BLOCK_P=max(16, triton.next_power_of_2(P)), BLOCK_X=1024)
    return gpu_ids.view(N, k)
