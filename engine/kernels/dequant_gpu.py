"""GGUF blocks dequantised on the GPU straight into expert cache slots: one kernel launch per part.

A quantised store's fill (engine/experts/cache.py) copies an expert's bytes into staging rows on the
device; each of its three parts (gate, up, down: engine/experts/store.py `QuantLayout`) is then one
launch here that reads the bytes once and writes the slot's dtype into the pool rows, where the torch
reference (engine/quant/blocks.py, kquants.py) is a chain of ops a part, a kernel each over int32/fp32
intermediates, then a cast and an `index_copy_`.

    dequantize_into(pool, slots, blocks, type_code, offset)
        pool (S, P) bf16/fp16/fp32, rows contiguous; slots (n,) int64 on pool's device;
        blocks (n, part bytes) uint8, unit stride along a row (a column range of the staging rows);
        writes pool[slots[i], offset : offset + weights] = the dequantised blocks[i]

Both kernels work on rows of 32 weights: a block of the 32-weight types (Q4_0 … Q8_0, MXFP4) or a
sub-block of the K-quants' 256-weight super-blocks (Q4_K, Q5_K, Q6_K), so per-row factors are loaded
once a row. The per-type decoding of such rows is in two helpers, `_values32` and `_values_k`, which
the quantised decode GEMVs (engine/kernels/quant_moe_gpu.py) call too. The arithmetic is the torch reference's, operand for operand (Q4_1: q·d + m; Q4_K:
(d·sc)·q − dmin·m; Q6_K: (d·sc)·(q − 32)): every product in it is exact in fp32, so only the one
addition rounds and a fused multiply-add rounds it the same way; the values equal gguf's bit for bit
in fp32 and are then rounded once to the pool's dtype.

bf16 is rounded here with integer ops (to nearest even, as torch rounds; NaN stays NaN) and stored as
its bits: Triton's interpreter (the tests on a CPU) truncates fp32 → bf16 casts, and doing the same
few integer ops on the GPU keeps one code path under test for a memory-bound kernel.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

from engine.quant.blocks import BLOCK, qtype

ROWS = 64  # rows of 32 weights a program: 2,048 outputs (4 KiB of bf16) from 1.1–2.2 KiB of blocks
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")


def interpreted() -> bool:
    """Whether the kernels were made for Triton's interpreter (TRITON_INTERPRET=1 when triton was first
    imported), which runs them on CPU tensors."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_dequant32_kernel, InterpretedFunction)


def available(device: torch.device) -> bool:
    """Triton importable and a CUDA device to compile for, or Triton's interpreter (CPU tensors)."""
    return triton is not None and (torch.device(device).type == "cuda" or interpreted())


if triton is not None:

    @triton.jit
    def _half_rows(base, row_ok):
        """(ROWS,) pointers → the little-endian fp16 in the two bytes at each, in fp32 (blocks of 17,
        18, … bytes leave it unaligned, so it is read as bytes)."""
        bits = (tl.load(base, mask=row_ok, other=0).to(tl.uint16)
                | (tl.load(base + 1, mask=row_ok, other=0).to(tl.uint16) << 8))
        return bits.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _store(out_ptr, idx, values, ok, BF16_BITS: tl.constexpr):
        """fp32 values (ROWS, 32) → the pool's dtype at out_ptr + idx; with BF16_BITS out_ptr is the bf16
        pool seen as int16 and the rounding (to nearest even) is done here."""
        if BF16_BITS:
            bits = values.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)  # NaN: the carry could make ±inf
            tl.store(out_ptr + idx, rounded.to(tl.uint16).to(tl.int16, bitcast=True), mask=ok)
        else:
            tl.store(out_ptr + idx, values.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _values32(base, row_ok, l, ok, QT: tl.constexpr, BB: tl.constexpr):
        """(R,) start pointers of blocks of type QT (ggml's code; BB bytes, 32 weights each) → their
        weights (R, 32) in fp32; row_ok (R,) and ok (R, 32) mask the loads, l = arange(0, 32)."""
        if QT == 8:  # Q8_0: d, 32 int8
            d = _half_rows(base, row_ok)
            q = tl.load(base[:, None] + 2 + l[None, :], mask=ok, other=0).to(tl.int8, bitcast=True)
            w = q.to(tl.float32) * d[:, None]
        elif QT == 39:  # MXFP4: exponent byte e, 16 bytes of E2M1 nibbles: doubled codes × 2^(e − 128)
            e = tl.load(base, mask=row_ok, other=0).to(tl.int32)
            # 2^(e − 128) from its bits: biased exponent e − 1, or for e = 0, 1 the subnormals 2^-128, 2^-127
            scale = tl.where(e >= 2, (e - 1) << 23, 0x00200000 << tl.minimum(e, 1)).to(tl.float32, bitcast=True)
            nib = (tl.load(base[:, None] + 1 + (l[None, :] % 16), mask=ok, other=0).to(tl.int32)
                   >> ((l[None, :] // 16) * 4)) & 0x0F
            c = nib & 7  # magnitude: doubled E2M1 values 0, 1, 2, 3, then (2 or 3)·2^(c/2 − 1) = 4, 6, 8, 12
            mag = tl.where(c < 4, c, (2 + (c & 1)) << tl.maximum((c >> 1) - 1, 0))
            q = tl.where(nib >= 8, -mag, mag)  # bit 3: the sign (nibble 8 is +0, as the reference's table)
            w = q.to(tl.float32) * scale[:, None]  # exact, or ±inf past fp32's range as gguf
        else:  # Q4_0, Q4_1, Q5_0, Q5_1: d [, m] [, qh], 16 bytes of nibbles last (low nibbles first)
            d = _half_rows(base, row_ok)
            q = (tl.load(base[:, None] + (BB - 16) + (l[None, :] % 16), mask=ok, other=0).to(tl.int32)
                 >> ((l[None, :] // 16) * 4)) & 0x0F
            if QT == 6 or QT == 7:  # Q5: bit l of the little-endian u32 qh is weight l's fifth bit
                qh = tl.load(base[:, None] + (2 if QT == 6 else 4) + l[None, :] // 8, mask=ok, other=0).to(tl.int32)
                q = q | (((qh >> (l[None, :] % 8)) & 1) << 4)
            if QT == 3 or QT == 7:
                m = _half_rows(base + 2, row_ok)
            else:  # (q − 8)·d or (q − 16)·d as q·d + m: both terms exact, so the sum is too
                m = -(8.0 if QT == 2 else 16.0) * d
            w = q.to(tl.float32) * d[:, None] + m[:, None]
        return w

    @triton.jit
    def _values_k(base, j, row_ok, l, ok, QT: tl.constexpr):
        """(R,) start pointers of super-blocks of K-quant type QT (ggml's code) and the sub-block j (R,)
        of each, 0–7 → the sub-blocks' 32 weights (R, 32) in fp32; masks and l as `_values32`'s."""
        if QT == 14:  # Q6_K: ql[128], qh[64], sc[16] int8, d; half h = j // 4, its sub-block p = j % 4
            h, p = j // 4, j % 4
            ql = tl.load(base[:, None] + (64 * h + 32 * (p % 2))[:, None] + l[None, :], mask=ok, other=0).to(tl.int32)
            qh = tl.load(base[:, None] + 128 + (32 * h)[:, None] + l[None, :], mask=ok, other=0).to(tl.int32)
            q = ((ql >> (4 * (p // 2))[:, None]) & 0x0F) | (((qh >> (2 * p)[:, None]) & 3) << 4)
            # the sub-block's two int8 scales (16 weights each), read once a row, not once a weight
            sc0 = tl.load(base + 192 + 2 * j, mask=row_ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            sc1 = tl.load(base + 193 + 2 * j, mask=row_ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            d = _half_rows(base + 208, row_ok)
            scale = tl.where(l[None, :] < 16, (d * sc0)[:, None], (d * sc1)[:, None])  # (R, 32) exact products
            w = scale * (q - 32).to(tl.float32)
        else:  # Q4_K, Q5_K: d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
            d, dmin = _half_rows(base, row_ok), _half_rows(base + 2, row_ok)
            # 6-bit scale and min of sub-block j: kquants.py's _scale_min, per row
            x = tl.load(base + 4 + j % 4, mask=row_ok, other=0).to(tl.int32)
            y = tl.load(base + 8 + j % 4, mask=row_ok, other=0).to(tl.int32)
            z = tl.load(base + 12 + j % 4, mask=row_ok, other=0).to(tl.int32)
            sc = tl.where(j < 4, x & 63, (z & 0x0F) | ((x >> 6) << 4))
            m = tl.where(j < 4, y & 63, (z >> 4) | ((y >> 6) << 4))
            qs = 16 if QT == 12 else 48  # where qs starts
            q = (tl.load(base[:, None] + qs + (32 * (j // 2))[:, None] + l[None, :], mask=ok, other=0).to(tl.int32)
                 >> (4 * (j % 2))[:, None]) & 0x0F
            if QT == 13:  # bit j of qh[l]: sub-block j's fifth bit
                qh = tl.load(base[:, None] + 16 + l[None, :], mask=ok, other=0).to(tl.int32)
                q = q | (((qh >> j[:, None]) & 1) << 4)
            scale = d * sc.to(tl.float32)  # (R,) exact
            low = dmin * m.to(tl.float32)  # (R,) exact
            w = scale[:, None] * q.to(tl.float32) - low[:, None]
        return w

    @triton.jit
    def _sub_blocks(rows, kb, row_ok, l, ok, QT: tl.constexpr, BB: tl.constexpr):
        """(R,) start pointers of matrix rows of type QT (ggml's code, BB bytes a block) and the sub-block
        kb (R,) of 32 weights to take from each → those weights (R, 32) in fp32; masks and l as
        `_values32`'s. A K-quant's sub-block kb is sub-block kb % 8 of super-block kb // 8."""
        if QT == 12 or QT == 13 or QT == 14:
            w = _values_k(rows + (kb // 8) * BB, kb % 8, row_ok, l, ok, QT)
        else:
            w = _values32(rows + kb * BB, row_ok, l, ok, QT, BB)
        return w

    @triton.jit
    def _dequant32_kernel(blocks_ptr, slots_ptr, out_ptr, stride_blocks, stride_out, offset, n_rows,
                          QT: tl.constexpr, BB: tl.constexpr, BF16_BITS: tl.constexpr, ROWS: tl.constexpr):
        """Program (tile, block row i): ROWS blocks of type QT (ggml's code; BB bytes, 32 weights each)
        of blocks[i] → pool[slots[i], offset + 32·r + l]."""
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,) blocks of this part
        i = tl.program_id(1)
        row_ok = r < n_rows
        l = tl.arange(0, 32)  # (32,) weight within a block
        ok = row_ok[:, None] & (l[None, :] < 32)  # (ROWS, 32)
        base = blocks_ptr + i.to(tl.int64) * stride_blocks + r.to(tl.int64) * BB  # (ROWS,) block starts
        w = _values32(base, row_ok, l, ok, QT, BB)  # (ROWS, 32)
        idx = offset + r.to(tl.int64)[:, None] * 32 + l[None, :]
        _store(out_ptr + tl.load(slots_ptr + i) * stride_out, idx, w, ok, BF16_BITS)

    @triton.jit
    def _dequant_k_kernel(blocks_ptr, slots_ptr, out_ptr, stride_blocks, stride_out, offset, n_rows,
                          QT: tl.constexpr, BB: tl.constexpr, BF16_BITS: tl.constexpr, ROWS: tl.constexpr):
        """Program (tile, block row i): ROWS sub-blocks of 32 weights (8 a super-block of BB bytes) of
        K-quant type QT (ggml's code) of blocks[i] → pool[slots[i], offset + 32·r + l]."""
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,) sub-blocks of this part
        i = tl.program_id(1)
        row_ok = r < n_rows
        l = tl.arange(0, 32)  # (32,) weight within a sub-block
        ok = row_ok[:, None] & (l[None, :] < 32)  # (ROWS, 32)
        base = blocks_ptr + i.to(tl.int64) * stride_blocks + (r // 8).to(tl.int64) * BB  # (ROWS,) super-block starts
        w = _values_k(base, r % 8, row_ok, l, ok, QT)  # (ROWS, 32)
        idx = offset + r.to(tl.int64)[:, None] * 32 + l[None, :]
        _store(out_ptr + tl.load(slots_ptr + i) * stride_out, idx, w, ok, BF16_BITS)


def dequantize_into(pool: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor, type_code: int,
                    offset: int) -> None:
    """blocks (n, part bytes) uint8 of ggml type `type_code`, each row one expert's part → pool[slots[i],
    offset : offset + weights] in pool's dtype, one launch on the current stream. Nothing is read back
    to the host."""
    qt = qtype(type_code)
    n, nbytes = blocks.shape
    if blocks.dtype != torch.uint8 or (nbytes > 1 and blocks.stride(1) != 1) or nbytes % qt.block_bytes:
        raise ValueError(f"{qt.name} blocks must be uint8 rows of whole {qt.block_bytes}-byte blocks, "
                         f"unit stride; got {tuple(blocks.shape)} {blocks.dtype}")
    n_rows = nbytes // qt.block_bytes * (qt.block_weights // BLOCK)  # rows of 32 weights
    if pool.dim() != 2 or pool.stride(1) != 1 or offset < 0 or offset + n_rows * BLOCK > pool.shape[1]:
        raise ValueError(f"{n_rows * BLOCK} weights at {offset} do not fit pool rows of {tuple(pool.shape)}")
    if pool.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"pool dtype {pool.dtype}: bf16, fp16 or fp32")
    if slots.shape != (n,) or slots.dtype != torch.int64 or slots.device != pool.device:
        raise ValueError(f"slots must be ({n},) int64 on {pool.device}")
    if n == 0 or n_rows == 0:
        return
    bf16 = pool.dtype == torch.bfloat16
    kernel = _dequant_k_kernel if qt.name in KQUANTS else _dequant32_kernel
    # tiles on axis 0 (up to 2^31 − 1 programs), blocks on axis 1 (a staging batch: ≤ 65,535)
    kernel[(triton.cdiv(n_rows, ROWS), n)](blocks, slots, pool.view(torch.int16) if bf16 else pool,
                                          blocks.stride(0), pool.stride(0), offset, n_rows,
                                          QT=qt.code, BB=qt.block_bytes, BF16_BITS=bf16, ROWS=ROWS)
