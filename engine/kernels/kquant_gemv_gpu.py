"""Dot products of K-quant rows (Q4_K, Q6_K) with a vector on the GPU, the blocks read as 16- or 32-bit
words: the inner step of the decode GEMVs (quant_moe_gpu's `_gemv`, hence quant_linear_gpu's too).

A decode GEMV over blocks is bound by how many bytes each multiprocessor has in flight, and a register
that holds one loaded byte (or one decoded fp32 weight) holds little: a program that loads a tile of
bytes, decodes it to fp32 and only then loads the next waits on memory once per small tile. Here a
program loads every super-block of its rows at once as words (a 32-bit word is 8 Q4_K weights), then
takes each word's nibbles apart in registers, so a row of 2,048 weights is one memory wait.

Within a super-block (256 weights, sub-blocks j of 32, kquants.py's layouts):
  Q4_K  qs[128]: 32-byte chunk c holds sub-block 2c (low nibbles) and 2c + 1 (high), weight l at byte l;
        w = (d·sc_j)·q − dmin·m_j, so a sub-block's dot is (d·sc_j)·Σq·x − (dmin·m_j)·Σx
  Q6_K  ql[128], qh[64], sc[16] int8, d: weight 128·h + 32·p + l (half h, quarter p, l < 32) takes
        ql[64h + 32(p % 2) + l] >> 4(p // 2) and (qh[32h + l] >> 2p) & 3 as its low four and top two
        bits; w = (d·sc)·(q − 32), one int8 scale for each 16 weights
The tile of a step is (row-super-block pairs RS, 4, words of 8 bytes' span): the last axis sums a
sub-block's (or a 16-weight scale group's) products, so per-sub-block factors multiply sums, not
weights. Every product and sum is fp32; only the order of the sums differs from decoding each weight.

Words need aligned addresses: Q4_K's 144-byte super-blocks read 32-bit words where every row start is a
multiple of 4 (WORD = 4), else 16-bit ones (WORD = 2); Q6_K's 210-byte ones always 16-bit words. The
caller (`word_bytes` below) picks WORD from the addresses it knows.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    from engine.kernels.dequant_gpu import _half_rows
except ImportError:
    triton = None

KQUANT_WORDS = (12, 14)  # ggml codes of the types read as words here: Q4_K, Q6_K


def word_bytes(*addresses: int) -> int:
    """The widest word (4 or 2 bytes) every one of these byte addresses / offsets / row lengths is a
    multiple of; 1: none (the byte-wise decoding then)."""
    return 4 if all(a % 4 == 0 for a in addresses) else 2 if all(a % 2 == 0 for a in addresses) else 1


if triton is not None:

    @triton.jit
    def _q4k_sums(vec, blk, sb, ok, WORD: tl.constexpr):
        """blk (RS,) super-block start pointers, sb (RS,) their index along the row, ok (RS,) → (RS,) fp32:
        each super-block's dot with vec's 256 matching elements."""
        W: tl.constexpr = 32 // WORD  # words of a 32-byte chunk
        c = tl.arange(0, 4)  # chunk: sub-blocks 2c, 2c + 1
        wi = tl.arange(0, W)
        ok3 = ok[:, None, None] & (wi[None, None, :] < W)
        ptr_t = tl.pointer_type(tl.int32) if WORD == 4 else tl.pointer_type(tl.uint16)
        words = tl.load((blk + 16).to(ptr_t)[:, None, None] + (W * c)[None, :, None] + wi[None, None, :],
                        mask=ok3, other=0).to(tl.int32)  # (RS, 4, W): 2·WORD nibbles each
        d, dmin = _half_rows(blk, ok), _half_rows(blk + 2, ok)
        xb = vec + sb.to(tl.int64) * 256  # (RS,) the super-block's activations
        total = tl.zeros(blk.shape, tl.float32)
        for h in tl.static_range(2):  # low nibbles: sub-block 2c; high: 2c + 1
            acc = tl.zeros((blk.shape[0], 4, W), tl.float32)
            xs = tl.zeros((blk.shape[0], 4, W), tl.float32)
            for b in tl.static_range(WORD):  # byte b of each word: weight WORD·wi + b of the sub-block
                q = ((words >> (8 * b + 4 * h)) & 15).to(tl.float32)
                x = tl.load(xb[:, None, None] + (64 * c + 32 * h)[None, :, None] + (WORD * wi + b)[None, None, :],
                            mask=ok3, other=0.0).to(tl.float32)
                acc += q * x
                xs += x
            j = 2 * c + h  # (4,) sub-blocks
            # 6-bit scale and min of sub-block j (kquants.py's _scale_min): bytes 4…15 after d and dmin
            lo = tl.load(blk[:, None] + 4 + (j % 4)[None, :], mask=ok[:, None], other=0).to(tl.int32)  # (RS, 4)
            mid = tl.load(blk[:, None] + 8 + (j % 4)[None, :], mask=ok[:, None], other=0).to(tl.int32)
            hi = tl.load(blk[:, None] + 12 + (j % 4)[None, :], mask=ok[:, None], other=0).to(tl.int32)
            first = (j < 4)[None, :]
            sc = tl.where(first, lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)).to(tl.float32)
            mn = tl.where(first, mid & 63, (hi >> 4) | ((mid >> 6) << 4)).to(tl.float32)
            total += tl.sum((d[:, None] * sc) * tl.sum(acc, 2) - (dmin[:, None] * mn) * tl.sum(xs, 2), 1)
        return total

    @triton.jit
    def _q6k_sums(vec, blk, sb, ok):
        """As `_q4k_sums` for Q6_K super-blocks, read as 16-bit words (210 bytes: 2-aligned only)."""
        g = tl.arange(0, 4)  # half h = g // 2, 16-weight scale group g % 2 of each quarter
        m = tl.arange(0, 8)  # word within the group: weights l = 16·(g % 2) + 2m + b
        ok3 = ok[:, None, None] & (m[None, None, :] < 8)
        wi = (64 * (g // 2) + 16 * (g % 2))[None, :, None] + 2 * m[None, None, :]  # (1, 4, 8) byte of ql
        u16 = tl.pointer_type(tl.uint16)
        ql_even = tl.load((blk[:, None, None] + wi).to(u16), mask=ok3, other=0).to(tl.int32)  # quarters 0, 2
        ql_odd = tl.load((blk[:, None, None] + wi + 32).to(u16), mask=ok3, other=0).to(tl.int32)  # quarters 1, 3
        qh = tl.load((blk[:, None, None] + 128 + (wi - 32 * (g // 2)[None, :, None])).to(u16), mask=ok3,
                     other=0).to(tl.int32)  # byte 128 + 32h + l
        d = _half_rows(blk + 208, ok)
        xb = vec + sb.to(tl.int64) * 256
        total = tl.zeros(blk.shape, tl.float32)
        for p in tl.static_range(4):
            ql = ql_even if p % 2 == 0 else ql_odd
            acc = tl.zeros((blk.shape[0], 4, 8), tl.float32)
            for b in tl.static_range(2):
                q = ((ql >> (8 * b + 4 * (p // 2))) & 15) | (((qh >> (8 * b + 2 * p)) & 3) << 4)
                at = (128 * (g // 2) + 32 * p + 16 * (g % 2))[None, :, None] + (2 * m + b)[None, None, :]
                x = tl.load(xb[:, None, None] + at, mask=ok3, other=0.0).to(tl.float32)
                acc += (q - 32).to(tl.float32) * x
            sc = tl.load(blk[:, None] + 192 + (8 * (g // 2) + 2 * p + g % 2)[None, :], mask=ok[:, None],
                         other=0).to(tl.int8, bitcast=True).to(tl.float32)  # (RS, 4)
            total += tl.sum((d[:, None] * sc) * tl.sum(acc, 2), 1)
        return total

    @triton.jit
    def dot_rows(vec, part, row0, n_rows, row_bytes, N_SB: tl.constexpr, QT: tl.constexpr, BB: tl.constexpr,
                 ROWS: tl.constexpr, S: tl.constexpr, WORD: tl.constexpr):
        """Rows row0 … row0 + ROWS − 1 (those < n_rows) of a matrix of type QT (Q4_K or Q6_K, BB bytes a
        super-block, N_SB a row of row_bytes) starting at `part` → (ROWS,) fp32 dot products with vec
        (256·N_SB elements). S super-blocks of each row a step; the steps are unrolled, so the loads of
        all of them can be in flight together."""
        rs = tl.arange(0, ROWS * S)
        r = row0 + rs // S  # (ROWS·S,) row of each (row, super-block) pair
        starts = part + r.to(tl.int64) * row_bytes
        acc = tl.zeros((ROWS * S,), tl.float32)
        for s0 in tl.static_range(0, N_SB, S):
            sb = s0 + rs % S  # (ROWS·S,) super-block along the row
            ok = (r < n_rows) & (sb < N_SB)
            blk = starts + sb * BB
            if QT == 12:
                acc += _q4k_sums(vec, blk, sb, ok, WORD)
            else:
                acc += _q6k_sums(vec, blk, sb, ok)
        return tl.sum(tl.reshape(acc, (ROWS, S)), 1)  # (ROWS,): row-major, so pair v is row v // S
