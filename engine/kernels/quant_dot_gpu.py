"""Dot products of GGUF blocks with int16 activations on the GPU: the inner loop of the decode GEMVs.

A decode matrix-vector product over quantised blocks should be bound by the bytes it reads. Decoding
each weight to fp32 and multiplying in fp32 made it bound by instructions instead (14–30 PTX
instructions a weight, tests/kernels/ptx_loop.py; one H100 read Q4_K experts at about 500 GB/s).
Here the activations are first quantised per block of 32 to int16 with one fp32 scale
(`quantize_rows`), and a sub-block of 32 weights is integer dot products between the weights' quants,
still packed four to a word as the file has them, and the activation's values (`dp2a`: two int16
values times two bytes of a word, one instruction). The per-sub-block factors are applied once to the
integer sums:

    Σ_i w_i x_i  ≈  dx · Σ_h (a_h · Σ_{i∈h} q_i xq_i  +  b_h · Σ_{i∈h} xq_i)

for w = a·q + b over each half h of 16 weights (a = d·sc, b = −dmin·m for Q4_K; a = d, b = −8·d for
Q4_0; Q6_K's halves have their own scales), x ≈ dx·xq. The rounding this adds is the activation's,
dx/2 = max|x| / 65534 of a block: the CPU kernels' (native/quant_kernels.h), which keep int16 rather
than ggml's int8 because int8 changed the built-in model's greedy answer. int8 would halve the
activation loads and the dot-product instructions (`dp4a`).

    quantize_rows(x) -> (words, scales, sums)
        x (N, K) bf16/fp16/fp32, K a multiple of 32 → the int16 values as int32 words (N, K/2), fp32
        scales (N, K/32), int32 sums of each half block's values (N, K/16)

`_gemv` is the jit function the kernels of quant_moe_gpu.py and quant_linear_gpu.py call. It reads
the blocks 16 bits at a time (every kept type but MXFP4 keeps its quants at even byte offsets, and
MXFP4's 17-byte blocks are read a byte at a time), so part offsets and row strides must be even.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from engine.kernels.dequant_gpu import _half_rows
except ImportError:
    triton = None

MXFP4 = 39  # ggml's code of the one kept type whose blocks (17 bytes) are read a byte at a time
QUANT_BLOCKS = 16  # blocks of 32 activations a program quantises: 512 values, a program a token for H = 512


if triton is not None:

    @triton.jit
    def _dp2a(lo, hi, q, DP2A: tl.constexpr):
        """Σ of four products: the int16 pair of `lo` with bytes 0, 1 of q and the pair of `hi` with bytes
        2, 3 (int32 tensors; the bytes signed int8, the halves little-endian): two instructions on the
        GPU; shifts and products in Triton's interpreter, which runs no PTX."""
        if DP2A:
            return tl.inline_asm_elementwise(
                "{ .reg .s32 t; dp2a.lo.s32.s32 t, $1, $3, 0; dp2a.hi.s32.s32 $0, $2, $3, t; }", "=r,r,r,r",
                [lo, hi, q], dtype=tl.int32, is_pure=True, pack=1)
        else:
            s = tl.zeros_like(q)
            for i in tl.static_range(4):
                half = lo if i < 2 else hi
                x = (half << (16 - 16 * (i % 2))) >> 16  # its int16
                s += x * ((q << (24 - 8 * i)) >> 24)
            return s

    @triton.jit
    def _word(p, ok, W32: tl.constexpr = False):
        """Byte pointers, each at an even address (W32: a multiple of 4) → the little-endian int32 at
        each: one 32-bit load, or two 16-bit ones (blocks of 18, 22, 34 or 210 bytes leave no 4-byte
        alignment)."""
        if W32:
            return tl.load(p.to(tl.pointer_type(tl.int32)), mask=ok, other=0)
        h = p.to(tl.pointer_type(tl.int16))
        lo = tl.load(h, mask=ok, other=0).to(tl.int32) & 0xFFFF
        return lo | (tl.load(h + 1, mask=ok, other=0).to(tl.int32) << 16)

    @triton.jit
    def _nibbles(word, shift):
        """The nibble at `shift` (0 or 4) of each of a word's four bytes, as four bytes 0–15."""
        return (word >> shift) & 0x0F0F0F0F

    @triton.jit
    def _fifth_bits(bits):
        """Four bits (0–15) → bit i moved to bit 4 of byte i: the fifth bit of four 5-bit quants."""
        return ((bits & 1) << 4) | ((bits & 2) << 11) | ((bits & 4) << 18) | ((bits & 8) << 25)

    @triton.jit
    def _factors(base, j, ok, QT: tl.constexpr):
        """R sub-blocks of type QT (ggml's code): base (R,) block starts (K-quants: super-block starts,
        j (R,) the sub-block 0–7 in each) → per half of 16 weights the factors a0, b0, a1, b1 (R,) fp32
        with w = a·q + b, and Q5_0 / Q5_1's fifth bits qh (R,) int32 (0 for the other types)."""
        qh = tl.zeros(j.shape, tl.int32)
        if QT == 8:  # Q8_0: d, 32 int8 quants
            a0 = _half_rows(base, ok)
            b0 = tl.zeros_like(a0)
            a1, b1 = a0, b0
        elif QT == 39:  # MXFP4: exponent byte e: 2^(e − 128) from its bits, biased exponent e − 1, or for
            # e = 0, 1 the subnormals 2^-128, 2^-127
            e = tl.load(base, mask=ok, other=0).to(tl.int32)
            a0 = tl.where(e >= 2, (e - 1) << 23, 0x00200000 << tl.minimum(e, 1)).to(tl.float32, bitcast=True)
            b0 = tl.zeros_like(a0)
            a1, b1 = a0, b0
        elif QT == 14:  # Q6_K: sc[16] int8 at 192, d at 208; two scales a sub-block, quants 0–63 stand for q − 32
            d = _half_rows(base + 208, ok)
            a0 = d * tl.load(base + 192 + 2 * j, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            a1 = d * tl.load(base + 193 + 2 * j, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            b0, b1 = -32.0 * a0, -32.0 * a1
        elif QT == 12 or QT == 13:  # Q4_K, Q5_K: d, dmin, scales[12]: sub-block j's 6-bit scale and min
            d, dmin = _half_rows(base, ok), _half_rows(base + 2, ok)
            x = tl.load(base + 4 + j % 4, mask=ok, other=0).to(tl.int32)  # kquants.py's _scale_min, per row
            y = tl.load(base + 8 + j % 4, mask=ok, other=0).to(tl.int32)
            z = tl.load(base + 12 + j % 4, mask=ok, other=0).to(tl.int32)
            a0 = d * tl.where(j < 4, x & 63, (z & 0x0F) | ((x >> 6) << 4)).to(tl.float32)
            b0 = -dmin * tl.where(j < 4, y & 63, (z >> 4) | ((y >> 6) << 4)).to(tl.float32)
            a1, b1 = a0, b0
        else:  # Q4_0, Q4_1, Q5_0, Q5_1: d [, m] [, qh]
            d = _half_rows(base, ok)
            if QT == 6 or QT == 7:  # bit l of the little-endian u32 qh is weight l's fifth bit
                qh = _word(base + (2 if QT == 6 else 4), ok)
            if QT == 3 or QT == 7:
                b0 = _half_rows(base + 2, ok)
            else:  # (q − 8)·d or (q − 16)·d
                b0 = -(8.0 if QT == 2 else 16.0) * d
            a0, a1, b1 = d, d, b0
        return a0, b0, a1, b1, qh

    @triton.jit
    def _quant_word(base, j, qh, ok, T: tl.constexpr, QT: tl.constexpr, BB: tl.constexpr, W32: tl.constexpr):
        """Word T (0–7) of R sub-blocks (as `_factors`' arguments): byte i is weight 4T + i's quant, a
        signed byte → (R,) int32. W32: the blocks' quants lie at multiples of 4 (`aligned`)."""
        if QT == 8:  # Q8_0: 32 int8 after d
            q = _word(base + 2 + 4 * T, ok)
        elif QT == 39:  # MXFP4: weight l's E2M1 code in nibble l // 16 of byte 1 + l % 16
            q = tl.zeros(j.shape, tl.int32)
            for i in tl.static_range(4):
                code = (tl.load(base + 1 + 4 * (T % 4) + i, mask=ok, other=0).to(tl.int32) >> (4 * (T // 4))) & 0x0F
                c = code & 7  # doubled magnitudes 0, 1, 2, 3, 4, 6, 8 (nibble c of 0x08643210), 12
                mag = tl.where(c == 7, 12, (0x08643210 >> (4 * c)) & 0x0F)
                q |= (tl.where(code >= 8, -mag, mag) & 0xFF) << (8 * i)
        elif QT == 14:  # Q6_K: ql[128], qh[64]; half h = j // 4, its sub-block p = j % 4
            h, p = j // 4, j % 4
            low = _nibbles(_word(base + 64 * h + 32 * (p % 2) + 4 * T, ok), 4 * (p // 2))
            q = low | (((_word(base + 128 + 32 * h + 4 * T, ok) >> (2 * p)) & 0x03030303) << 4)
        elif QT == 12 or QT == 13:  # Q4_K, Q5_K: qs[128] (at 16, or 48 after Q5_K's qh[32]); sub-blocks
            # 2i and 2i + 1 share 32 bytes, low and high nibbles
            q = _nibbles(_word(base + (16 if QT == 12 else 48) + 32 * (j // 2) + 4 * T, ok, W32), 4 * (j % 2))
            if QT == 13:  # bit j of qh[l]: weight l's fifth bit
                q |= ((_word(base + 16 + 4 * T, ok, W32) >> j) & 0x01010101) << 4
        else:  # Q4_0 … Q5_1: 16 bytes of nibbles last, weights l and l + 16 in byte l
            q = _nibbles(_word(base + (BB - 16) + 4 * (T % 4), ok, W32), 4 * (T // 4))
            if QT == 6 or QT == 7:
                q |= _fifth_bits((qh >> (4 * T)) & 0x0F)
        return q

    @triton.jit
    def _gemv(xw_ptr, xd_ptr, xs_ptr, rows, row_ok, n_sub, QT: tl.constexpr, BB: tl.constexpr,
              ROWS: tl.constexpr, C: tl.constexpr, DP2A: tl.constexpr, W32: tl.constexpr):
        """Dot products of ROWS matrix rows of type QT (ggml's code, BB bytes a block) with one quantised
        activation vector of K = 32·n_sub (`quantize_rows`' words, scales and half sums at xw, xd, xs):
        rows (ROWS·C,) are the start pointers of the row each of the C sub-block slots a row belongs to,
        row_ok (ROWS·C,) masks them → (ROWS,) fp32. W32: the rows' quants may be read 32 bits at a time
        (`aligned`).

        Every tensor is (ROWS·C,), one sub-block an element, and its 8 words are unrolled: a thread
        decodes its sub-blocks' factors once and sums their words itself, with no data moved between
        threads (an (R, 8) tile of words spread sub-blocks over two threads here)."""
        c = tl.arange(0, ROWS * C) % C  # (ROWS·C,) slot within its row
        x64 = xw_ptr.to(tl.pointer_type(tl.int64))  # activation values 4T … 4T + 3 of a sub-block: one int64
        acc = tl.zeros((ROWS * C,), tl.float32)
        for k0 in range(0, n_sub, C):
            kb = k0 + c  # (ROWS·C,) sub-block along the row
            ok = row_ok & (kb < n_sub)
            if QT == 12 or QT == 13 or QT == 14:  # sub-block kb % 8 of super-block kb // 8
                base, j = rows + (kb // 8) * BB, kb % 8
            else:
                base, j = rows + kb * BB, kb
            a0, b0, a1, b1, qh = _factors(base, j, ok, QT)
            i0 = tl.zeros((ROWS * C,), tl.int32)  # Σ q·xq over each half of 16 weights
            i1 = tl.zeros((ROWS * C,), tl.int32)
            for T in tl.static_range(8):
                xv = tl.load(x64 + kb * 8 + T, mask=ok, other=0)
                dot = _dp2a(xv.to(tl.int32), (xv >> 32).to(tl.int32), _quant_word(base, j, qh, ok, T, QT, BB, W32), DP2A)
                if T < 4:
                    i0 += dot
                else:
                    i1 += dot
            s0 = tl.load(xs_ptr + 2 * kb, mask=ok, other=0).to(tl.float32)  # (ROWS·C,) Σ xq of each half
            s1 = tl.load(xs_ptr + 2 * kb + 1, mask=ok, other=0).to(tl.float32)
            dx = tl.load(xd_ptr + kb, mask=ok, other=0.0)
            acc += dx * (a0 * i0.to(tl.float32) + b0 * s0 + a1 * i1.to(tl.float32) + b1 * s1)
        return tl.sum(tl.reshape(acc, (ROWS, C)), 1)  # (ROWS,): row-major, so slot v is row v // C

    @triton.jit
    def _quantize_kernel(x_ptr, words_ptr, scales_ptr, sums_ptr, K, BLOCKS: tl.constexpr):
        """Program (tile, row m): BLOCKS blocks of 32 of x[m] → int16 values q = round(x / dx) (stored at
        words_ptr seen as int16), dx = max |x| / 32767, and the sums of q over each half block."""
        m = tl.program_id(1)
        n_blocks = K // 32
        b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)  # (BLOCKS,) block along the row
        l = tl.arange(0, 32)
        ok_b = b < n_blocks
        ok = ok_b[:, None] & (l[None, :] < 32)  # (BLOCKS, 32)
        at = m.to(tl.int64) * K + b[:, None] * 32 + l[None, :]
        x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)  # (BLOCKS, 32)
        amax = tl.max(tl.abs(x), 1)  # (BLOCKS,)
        v = x * tl.where(amax > 0, 32767.0 / tl.maximum(amax, 1e-30), 0.0)[:, None]  # in [−32767, 32767]; zeros stay 0
        q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v)).to(tl.int32)  # to nearest, ties away from 0
        tl.store(words_ptr.to(tl.pointer_type(tl.int16)) + at, q.to(tl.int16), mask=ok)
        tl.store(scales_ptr + m * n_blocks + b, amax / 32767.0, mask=ok_b)
        sums = sums_ptr + m * 2 * n_blocks + 2 * b
        tl.store(sums, tl.sum(tl.where(l[None, :] < 16, q, 0), 1), mask=ok_b)
        tl.store(sums + 1, tl.sum(tl.where(l[None, :] < 16, 0, q), 1), mask=ok_b)


def dp2a() -> bool:
    """Whether the kernels are compiled for a GPU (the dp2a instruction) rather than run by Triton's
    interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(_quantize_kernel, InterpretedFunction)


ALIGNED_TYPES = (3, 7, 12, 13)  # Q4_1, Q5_1, Q4_K, Q5_K: blocks of 20, 24, 144, 176 bytes, quants at 4k


def aligned(type_code: int, *byte_counts: int) -> bool:
    """Whether a part of this type whose rows start at these byte counts (offsets, strides, addresses)
    has every quant word at a multiple of 4: then one 32-bit load reads it, not two 16-bit ones."""
    return type_code in ALIGNED_TYPES and all(n % 4 == 0 for n in byte_counts)


def check_even(name: str, type_code: int, **byte_counts: int) -> None:
    """Refuses a part whose quants `_gemv_q8` would read as 16-bit words at odd addresses (a misaligned
    load stops the whole CUDA context): every byte count given (offsets, strides, addresses) must be
    even, except for MXFP4, read a byte at a time."""
    odd = [f"{what} {n}" for what, n in byte_counts.items() if n % 2]
    if odd and type_code != MXFP4:
        raise ValueError(f"{name}: the GPU kernels read blocks 16 bits at a time; odd {', '.join(odd)}")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, K) float, K a multiple of 32 → (words (N, K/2) int32: two int16 values each, little-endian;
    scales (N, K/32) fp32; sums (N, K/16) int32 of the int16 values of each half block). One launch on the
    current stream, nothing read back to the host."""
    N, K = x.shape
    if K % 32:
        raise ValueError(f"rows of {K} activations are not whole blocks of 32")
    x = x.contiguous()
    words = torch.empty(N, K // 2, dtype=torch.int32, device=x.device)
    scales = torch.empty(N, K // 32, dtype=torch.float32, device=x.device)
    sums = torch.empty(N, K // 16, dtype=torch.int32, device=x.device)
    if N and K:
        _quantize_kernel[(triton.cdiv(K // 32, QUANT_BLOCKS), N)](x, words, scales, sums, K, BLOCKS=QUANT_BLOCKS)
    return words, scales, sums
