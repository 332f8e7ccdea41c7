"""Routed experts for a few tokens as three GPU kernels that read each chosen expert's weights in place.

At decode (1–8 tokens, top-k of 8 out of 128 experts) the grouped GEMM path sorts the pairs, gathers
the rows, runs two CUTLASS grouped GEMMs over 128 mostly empty groups and scatters back: ~12 kernels
and ~44 µs a layer on an H200 where the 75 MB of weights need ~16 µs at HBM speed. Here each
(token, choice) pair is a matrix-vector product straight out of the fused expert tensors; on an
H200 the three kernels take ~27 µs a layer at one token:

  1. gate_up: program (pair p, row tile) computes gate and up rows of expert ids[p] for token p // k,
     applies SiLU(gate) · up and writes act (P, I);
  2. down: program (pair p, row tile) writes y[p] = w[p] · down[ids[p]] @ act[p];
  3. a sum over each token's k choices in fp32 writes out (N, H): no sort, no scatter, no zero fill.

Intermediate roundings follow the reference (experts_torch.moe_experts): gate and up and the
activation are rounded to the model dtype as F.linear would; the weighted sum over the k choices is
kept in fp32 (the reference adds in the model dtype, in expert order), so bf16 results can differ in
the last bit. Nothing reads back to the host: a CUDA graph can capture it.

    moe_decode(x, ids, weights, gate_up, down) -> out
        x (N, H); ids (N, k) int; weights (N, k); gate_up (E, 2I, H) gate rows first; down (E, H, I)

An id outside [0, E) skips its pair (it adds zero and reads no weights): the offloaded experts pass
slot ids of a cache pool and mark the pairs the CPU computes that way. With an offset table the ids
are expert ids and each expert's weights may sit anywhere the GPU can address, the pinned host store
included (`engine/experts/zero_copy.py`).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_TOKENS = 8  # beyond this, tokens sharing an expert make the grouped GEMM's one weight read win


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.shape[0] <= MAX_TOKENS


if triton is not None:

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, ids_ptr, offs_ptr, spare_ptr, act_ptr, H, I, E, top_k, stride_we, stride_wr,
                        HAS_OFFS: tl.constexpr, HAS_SPARE: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_H: tl.constexpr):
        p = tl.program_id(0)  # (token, choice) pair
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # rows of the gate half
        e = tl.load(ids_ptr + p).to(tl.int64)
        n_rows = tl.where((e >= 0) & (e < E), I, 0)  # a skipped pair loads nothing and stores zeros
        row_ok = rows < n_rows
        store_ok = rows < I
        t = p // top_k
        e_ok = tl.where((e >= 0) & (e < E), e, 0)  # an in-range index for the table read
        base = w_ptr + (tl.load(offs_ptr + e_ok) if HAS_OFFS else e * stride_we)
        if HAS_SPARE:  # this pair copies the weights it reads into a free slot (-1: none)
            sp = tl.load(spare_ptr + p)
            copy_row = rows < tl.where(sp >= 0, n_rows, 0)
            spare = w_ptr + tl.where(sp >= 0, sp, 0)
        acc_gate = tl.zeros((BLOCK_R,), tl.float32)
        acc_up = tl.zeros((BLOCK_R,), tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            h_ok = h < H
            xv = tl.load(x_ptr + t * H + h, mask=h_ok, other=0.0).to(tl.float32)  # (BLOCK_H,)
            ok = row_ok[:, None] & h_ok[None, :]
            wg = tl.load(base + rows[:, None] * stride_wr + h[None, :], mask=ok, other=0.0)  # (BLOCK_R, BLOCK_H)
            wu = tl.load(base + (rows + I)[:, None] * stride_wr + h[None, :], mask=ok, other=0.0)
            if HAS_SPARE:
                copy = copy_row[:, None] & h_ok[None, :]
                tl.store(spare + rows[:, None] * stride_wr + h[None, :], wg, mask=copy)
                tl.store(spare + (rows + I)[:, None] * stride_wr + h[None, :], wu, mask=copy)
            acc_gate += tl.sum(wg.to(tl.float32) * xv[None, :], 1)
            acc_up += tl.sum(wu.to(tl.float32) * xv[None, :], 1)
        dtype = act_ptr.dtype.element_ty
        gate = acc_gate.to(dtype).to(tl.float32)  # F.linear's output rounding
        up = acc_up.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(act_ptr + p * I + rows, (silu * up).to(dtype), mask=store_ok)

    @triton.jit
    def _down_kernel(act_ptr, w_ptr, ids_ptr, offs_ptr, spare_ptr, wts_ptr, y_ptr, H, I, E, stride_we, stride_wr,
                     HAS_OFFS: tl.constexpr, HAS_SPARE: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_I: tl.constexpr):
        p = tl.program_id(0)  # (token, choice) pair
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # output features
        e = tl.load(ids_ptr + p).to(tl.int64)
        n_rows = tl.where((e >= 0) & (e < E), H, 0)
        row_ok = rows < n_rows
        store_ok = rows < H
        e_ok = tl.where((e >= 0) & (e < E), e, 0)
        base = w_ptr + (tl.load(offs_ptr + e_ok) if HAS_OFFS else e * stride_we)
        if HAS_SPARE:
            sp = tl.load(spare_ptr + p)
            copy_row = rows < tl.where(sp >= 0, n_rows, 0)
            spare = w_ptr + tl.where(sp >= 0, sp, 0)
        acc = tl.zeros((BLOCK_R,), tl.float32)
        for i0 in range(0, I, BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            i_ok = i < I
            a = tl.load(act_ptr + p * I + i, mask=i_ok, other=0.0).to(tl.float32)  # (BLOCK_I,)
            ok = row_ok[:, None] & i_ok[None, :]
            wd = tl.load(base + rows[:, None] * stride_wr + i[None, :], mask=ok, other=0.0)  # (BLOCK_R, BLOCK_I)
            if HAS_SPARE:
                tl.store(spare + rows[:, None] * stride_wr + i[None, :], wd, mask=copy_row[:, None] & i_ok[None, :])
            acc += tl.sum(wd.to(tl.float32) * a[None, :], 1)
        dtype = y_ptr.dtype.element_ty
        w = tl.load(wts_ptr + p).to(tl.float32)
        y = acc.to(dtype).to(tl.float32)  # the expert's output, rounded as F.linear's
        tl.store(y_ptr + p * H + rows, (y * w).to(dtype), mask=store_ok)  # weighted in the model dtype

    @triton.jit
    def _claim_kernel(ids_ptr, offs_ptr, spares_ptr, counter_ptr, spare_of_pair_ptr, log_ptr, victims_ptr, table_ptr,
                      host_table_ptr, E, pool_numel, n_spares, LOG: tl.constexpr, EVICT: tl.constexpr):
        p = tl.program_id(0)  # (token, choice) pair
        e = tl.load(ids_ptr + p).to(tl.int64)
        if LOG:
            tl.store(log_ptr + p, e)
        valid = (e >= 0) & (e < E)
        off = tl.load(offs_ptr + tl.where(valid, e, 0))
        outside = valid & ((off < 0) | (off >= pool_numel))  # the expert is not in a slot of the pool
        c = tl.atomic_add(counter_ptr, outside.to(tl.int32))  # this pair's place in the list of free slots (adds 0 for the rest)
        ok = outside & (c < n_spares)
        sp = tl.load(spares_ptr + tl.where(ok, c, 0))
        tl.store(spare_of_pair_ptr + p, tl.where(ok, sp, -1))
        if EVICT:  # the slot still holds a cached expert: from now on its readers go to the store
            v = tl.load(victims_ptr + tl.where(ok, c, 0))
            evict = ok & (v >= 0)
            v_ok = tl.where(evict, v, 0)
            tl.store(table_ptr + v_ok, tl.load(host_table_ptr + v_ok), mask=evict)

    @triton.jit
    def _sum_choices_kernel(y_ptr, out_ptr, ids_ptr, spare_ptr, offs_ptr, expect_ptr, done_ptr, cpu_out_ptr, error_ptr,
                            max_polls, H, top_k, P, ADMIT: tl.constexpr, WAIT_CPU: tl.constexpr,
                            SYS_FENCE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
        t = tl.program_id(0)
        if ADMIT:  # the fills of this token's pairs are written: point their experts' entries at the slots
            if tl.program_id(1) == 0:
                q = tl.arange(0, BLOCK_P)
                ids_all = tl.load(ids_ptr + q, mask=q < P, other=-1)
                claimed_all = tl.load(spare_ptr + q, mask=q < P, other=-1) >= 0
                for j in range(0, top_k):
                    p = t * top_k + j
                    e = tl.load(ids_ptr + p).to(tl.int64)
                    sp = tl.load(spare_ptr + p)
                    # two tokens that filled the same expert: the first pair's slot is the one kept
                    earlier = tl.sum(((q < p) & (ids_all == e) & claimed_all).to(tl.int32), 0)
                    admit = (sp >= 0) & (earlier == 0)
                    tl.store(offs_ptr + tl.where(admit, e, 0), sp, mask=admit)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < H
        total = tl.zeros((BLOCK,), tl.float32)
        for j in range(0, top_k):
            total += tl.load(y_ptr + (t * top_k + j) * H + cols, mask=ok, other=0.0).to(tl.float32)
        if WAIT_CPU:  # the CPU's pairs of this layer (engine/kernels/cpu_mailbox_gpu.py): wait for its sum
            want = tl.load(expect_ptr)  # the layer's post number, 0: nothing was posted
            seen = want * 0
            polls = 0
            while (seen < want) & (polls < max_polls):
                seen = tl.load(done_ptr, volatile=True)  # host memory, read afresh over PCIe each time
                polls += 1
            if SYS_FENCE:
                tl.inline_asm_elementwise("fence.sc.sys;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                          is_pure=False, pack=1)
            # (masks from the loop's values go through tl.where: the interpreter takes them as int32)
            n_cols = tl.where((want > 0) & (seen >= want), H, 0)  # nothing is read from the host without an answer
            total += tl.load(cpu_out_ptr + t * H + cols, mask=cols < n_cols, other=0.0, volatile=True)
            tl.atomic_max(error_ptr, tl.where((want > 0) & (seen < want), 1, 0))  # no answer in time: the step is wrong
        tl.store(out_ptr + t * H + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


def claim_free_slots(ids: torch.Tensor, offsets: torch.Tensor, spares: torch.Tensor, counter: torch.Tensor,
                     pool_numel: int, out: torch.Tensor | None = None, log: torch.Tensor | None = None,
                     evict: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """For each (token, choice) pair whose expert's offset lies outside the pool (read from the host
    store), the next entry of `spares` (element offsets of free slots; -1 past the list's end), in the
    order an atomic counter hands them out → (N·k,) int64 spare offset per pair, -1 for the rest.
    counter (1,) int32 is the number handed out so far (reset by the caller between steps).
    out (N·k,) int64, optional: written instead of a new tensor. log (N·k,) int64, optional: each pair's
    expert id is written there too. The zero-copy decode keeps both per layer for the host; written
    here, they cost no copy kernels of their own (two a layer, ~2 µs each in a graph on an H200).
    evict = (victims (S,) int64, table (L·E,) int64, host_table (L·E,) int64), optional: a listed slot may
    still hold a cached expert, victims[c] its flat (layer · E + expert) index in the offset table
    (-1: the slot is free); the pair that claims it points that entry back to the store
    (host_table's value) before any later kernel reads the table, so the victim stays cached until
    its slot is really taken (engine/experts/zero_copy.py)."""
    P = ids.numel()
    spare_of_pair = torch.empty(P, dtype=torch.int64, device=ids.device) if out is None else out
    for t in (spare_of_pair, log):
        assert t is None or (t.numel() == P and t.dtype == torch.int64 and t.is_contiguous()), "(N·k,) int64, contiguous"
    victims, table, host_table = (spares,) * 3 if evict is None else evict
    assert victims.shape == spares.shape and table.shape == host_table.shape and table.is_contiguous()
    if P:
        _claim_kernel[(P,)](ids.contiguous(), offsets, spares, counter, spare_of_pair,
                            spare_of_pair if log is None else log, victims, table, host_table, offsets.shape[0],
                            pool_numel, spares.shape[0], LOG=log is not None, EVICT=evict is not None)
    return spare_of_pair


def moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, offsets: torch.Tensor | None = None, out: torch.Tensor | None = None,
               spare: torch.Tensor | None = None, admit: bool = False, cpu: tuple | None = None) -> torch.Tensor:
    """offsets (E,) int64, optional: expert e starts `offsets[e]` elements past gate_up's (and down's)
    first element instead of at e · stride(0). The offloaded experts pass the pool's views and an
    offset per expert of the layer: into a cache slot, or into the pinned host store, which the
    kernel then reads in place over PCIe (mapped memory: the same element distance applies to the
    gate_up and the down view of a block). out (N, H), optional: written instead of a new tensor.
    spare (N·k,) int64, optional (with offsets): pair p also writes the weights it reads to the block
    `spare[p]` elements past the pool's start (a free slot; -1: no copy) — a fill over the same PCIe
    read that computes with the expert. admit (with spare): once the fills are written, each filled
    expert's entry of `offsets` points at its slot (the first pair's, where two tokens filled one
    expert), so the next replay finds it there without the host. cpu = (expect (1,) int64, done (1,)
    int64 in host memory, cpu_out (≥N, H) fp32 in host memory, error (1,) int32, max_polls), optional:
    the sum waits for the CPU mailbox's answer to the layer's post and adds its sum
    (engine/kernels/cpu_mailbox_gpu.py)."""
    N, H = x.shape
    k = ids.shape[1]
    I = down.shape[2]
    assert gate_up.shape[1:] == (2 * I, H) and down.shape[1] == H
    assert gate_up.stride(2) == 1 and down.stride(2) == 1, "expert rows must be contiguous"
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    P = N * k
    act = torch.empty((P, I), device=x.device, dtype=x.dtype)
    y = torch.empty((P, H), device=x.device, dtype=x.dtype)  # each pair's weighted expert output
    out = torch.empty_like(x) if out is None else out  # (N, H)
    if N == 0:
        return out
    E = gate_up.shape[0] if offsets is None else offsets.shape[0]
    offs = ids if offsets is None else offsets  # any int64 tensor stands in when unused
    sp = ids if spare is None else spare
    # Few rows per program and whole 1024-wide stretches of them: thousands of programs even for one
    # token, so that every multiprocessor has many loads in flight (the GEMV is bandwidth-bound).
    _gate_up_kernel[(P, triton.cdiv(I, 4))](x, gate_up, ids, offs, sp, act, H, I, E, k, gate_up.stride(0),
                                            gate_up.stride(1), HAS_OFFS=offsets is not None,
                                            HAS_SPARE=spare is not None,
                                            BLOCK_R=4, BLOCK_H=min(1024, triton.next_power_of_2(H)))
    _down_kernel[(P, triton.cdiv(H, 8))](act, down, ids, offs, sp, weights, y, H, I, E, down.stride(0),
                                         down.stride(1), HAS_OFFS=offsets is not None, HAS_SPARE=spare is not None,
                                         BLOCK_R=8, BLOCK_I=min(1024, triton.next_power_of_2(I)))
    assert not admit or (offsets is not None and spare is not None), "admit needs offsets and spare"
    return sum_choices(y, out, ids, sp, offs, admit, cpu)


def sum_choices(y: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, spare: torch.Tensor, offsets: torch.Tensor,
                admit: bool, cpu: tuple | None) -> torch.Tensor:
    """The last launch of a decode step's experts: out (N, H) = Σ over each token's k pairs of y (N·k, H),
    fp32 sums; with admit, each filled expert's entry of offsets points at its spare slot; with cpu (the
    mailbox's wait arguments, as moe_decode's), the CPU's sum for the layer added. spare and offsets:
    any int64 tensors where unused."""
    N, H = out.shape
    P = y.shape[0]
    if cpu is None:  # any tensors stand in for the mailbox's when unused
        expect = done = error = ids
        cpu_out, max_polls = y, 0
    else:
        expect, done, cpu_out, error, max_polls = cpu
    _sum_choices_kernel[(N, triton.cdiv(H, 1024))](y, out, ids, spare, offsets, expect, done, cpu_out, error, max_polls,
                                                   H, P // N, P, ADMIT=admit, WAIT_CPU=cpu is not None,
                                                   SYS_FENCE=y.is_cuda, BLOCK=1024,
                                                   BLOCK_P=triton.next_power_of_2(P))
    return out
