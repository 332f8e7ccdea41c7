"""Paged decode attention on the GPU: each sequence's one new query reads its keys in place.

The resident KV pool is (slots, n_kv, hs) per layer and a sequence owns a list of blocks scattered
through it. Gathering those blocks into a contiguous tensor every step reads and writes the whole
KV twice more than attention needs; this kernel instead follows the block table (key j of sequence
b lives at slot table[b, j // block] · block + j % block) and reads each key once.

Flash-decoding split: grid (B, n_kv, n_splits). A program holds its GQA group's G = nh / n_kv query
heads, walks BLOCK_N keys at a time of its share of the sequence with an online softmax in fp32, and
writes a partial (o, lse); a second kernel merges the splits by log-sum-exp. Splitting the sequence
keeps all multiprocessors busy at bs=1, where B · n_kv programs alone would leave most idle.

    paged_decode(q, k_pool, v_pool, table, lengths, block_size, scale, n_splits, window=None) -> (o, lse)
        q (B, nh, hs); k_pool, v_pool (slots, n_kv, hs) with a contiguous last dim;
        table (B, max_blocks) int32/int64 block ids; lengths (B,) int32/int64 keys per sequence (incl. the
        new one); n_splits from split_count (a sequence's keys are cut into that many equal runs)
        o (B, nh, hs) fp32, lse (B, nh) fp32 natural-log; a sequence with no keys gives o 0, lse −inf.

Triton ships with PyTorch's CUDA builds; `available()` says whether this process can use it.
With TRITON_INTERPRET=1 the same kernels run on CPU tensors (how the tests check them without a GPU).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the resident KV keeps its gather path
    triton = None

_LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per inner iteration: a 64 × hs tile of K and of V


def available(device: torch.device) -> bool:
    """Compiled kernels need CUDA; the interpreter (tests) is only ever asked for explicitly."""
    return triton is not None and device.type == "cuda"


def supports_head_dim(hs: int) -> bool:
    return hs >= 16 and hs & (hs - 1) == 0  # tl.dot's smallest tile; tl.arange needs powers of two


if triton is not None:

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, o_part_ptr, lse_part_ptr,
                      stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tb,
                      scale_log2, block_size, window, n_splits, nh,
                      G: tl.constexpr, G_PAD: tl.constexpr, HS: tl.constexpr, BLOCK: tl.constexpr,
                      PRECISION: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(len_ptr + b)
        lo = tl.maximum(length - window, 0)  # window = length for full attention
        # Each sequence splits its own span in whole tiles: no host-side bound on the lengths, so the
        # launch is the same every step (a CUDA graph replays it) and short sequences split finer.
        keys_per_split = tl.cdiv(tl.cdiv(length - lo, n_splits), BLOCK) * BLOCK
        start = lo + split * keys_per_split
        end = tl.minimum(start + keys_per_split, length)

        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HS)
        head = kvh * G + g  # query heads of this KV head's group
        g_ok = g < G
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None], other=0.0)  # (G_PAD, HS), model dtype
        m = tl.full((G_PAD,), float("-inf"), tl.float32)  # running max, log2 units
        l = tl.zeros((G_PAD,), tl.float32)  # running sum of exp2(score − m)
        acc = tl.zeros((G_PAD, HS), tl.float32)
        for n0 in range(start, end, BLOCK):
            j = n0 + tl.arange(0, BLOCK)  # key positions
            valid = j < end
            blk = tl.load(table_ptr + b * stride_tb + j // block_size, mask=valid, other=0)
            slot = blk.to(tl.int64) * block_size + j % block_size  # (BLOCK,)
            kt = tl.load(k_ptr + slot[None, :] * stride_ks + kvh * stride_kh + d[:, None],
                         mask=valid[None, :], other=0.0)  # (HS, BLOCK)
            s = tl.dot(q, kt, input_precision=PRECISION) * scale_log2  # (G_PAD, BLOCK) fp32
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            vt = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                         mask=valid[:, None], other=0.0)  # (BLOCK, HS)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
            m = m_new
        has_keys = l > 0
        o = acc / tl.where(has_keys, l, 1.0)[:, None]
        lse = tl.where(has_keys, (m + tl.log2(tl.where(has_keys, l, 1.0))) / 1.4426950408889634,
                       float("-inf"))
        row = (b * nh + head) * n_splits + split  # partials laid out (B, nh, n_splits, ·)
        tl.store(o_part_ptr + row[:, None] * HS + d[None, :], o, mask=g_ok[:, None])
        tl.store(lse_part_ptr + row, lse, mask=g_ok)

    @triton.jit
    def _merge_kernel(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, n_splits,
                      HS: tl.constexpr, SPLITS_PAD: tl.constexpr):
        bh = tl.program_id(0)  # b · nh + h
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HS)
        s_ok = s < n_splits
        lse = tl.load(lse_part_ptr + bh * n_splits + s, mask=s_ok, other=float("-inf"))  # (S,)
        top = tl.max(lse, 0)
        safe_top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(lse - safe_top)  # 0 for empty splits
        total = tl.sum(w, 0)
        o = tl.load(o_part_ptr + (bh * n_splits + s)[:, None] * HS + d[None, :],
                    mask=s_ok[:, None], other=0.0)  # (S, HS)
        merged = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(o_ptr + bh * HS + d, merged.to(o_ptr.dtype.element_ty))  # fp32, or the model dtype (out)
        tl.store(lse_ptr + bh, tl.where(total > 0, safe_top + tl.log(total), float("-inf")))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


PROGRAMS_PER_SM = 4  # splits enough to hide memory latency: on an H200 4 beat 2 by 1.4–1.6× at bs=4, 8K–32K


def split_count(max_keys: int, batch: int, n_kv: int, device: torch.device) -> int:
    """Splits per sequence so that B · n_kv · splits fills the GPU about PROGRAMS_PER_SM times over."""
    want = max(1, -(-PROGRAMS_PER_SM * _multiprocessors(device) // (batch * n_kv)))
    return max(1, min(want, -(-max_keys // BLOCK_N)))


def scratch_for(batch: int, n_heads: int, head_dim: int, splits: int, device: torch.device) -> tuple:
    """The partials and outputs of one call, (o_part, lse_part, o, lse): allocate once per decode
    step and pass to every layer's call (each layer's output is consumed before the next runs)."""
    f32 = dict(device=device, dtype=torch.float32)
    return (torch.empty((batch, n_heads, splits, head_dim), **f32), torch.empty((batch, n_heads, splits), **f32),
            torch.empty((batch, n_heads, head_dim), **f32), torch.empty((batch, n_heads), **f32))


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                 lengths: torch.Tensor, block_size: int, scale: float, n_splits: int,
                 window: int | None = None, scratch: tuple | None = None,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """scratch: `scratch_for(B, nh, hs, n_splits, device)`, reused across calls. out (B, nh, hs),
    optional, contiguous, any float dtype: the merge writes the output there, rounded once (instead of
    the scratch's fp32 output and a cast kernel after it). Nothing here reads a device value back, so
    the call can be captured in a CUDA graph."""
    B, nh, hs = q.shape
    n_kv = k_pool.shape[1]
    G = nh // n_kv
    assert q.stride(-1) == 1 and k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1 and lengths.stride(0) == 1
    assert supports_head_dim(hs), "head dim must be a power of two ≥ 16"
    splits = n_splits
    o_part, lse_part, o, lse = scratch if scratch is not None else scratch_for(B, nh, hs, splits, q.device)
    assert o_part.shape == (B, nh, splits, hs), "scratch sized for another batch or split count"
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _split_kernel[(B, n_kv, splits)](
        q, k_pool, v_pool, table, lengths, o_part, lse_part,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        table.stride(0), scale * _LOG2E, block_size,
        window if window is not None else 2**30, splits, nh,
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), HS=hs, BLOCK=BLOCK_N, PRECISION=precision,
        num_stages=2)  # two stages beat three in the sweep (less shared memory, more programs resident)
    if out is not None:
        assert out.shape == (B, nh, hs) and out.is_contiguous(), "out: (B, nh, hs), contiguous"
        o = out
    _merge_kernel[(B * nh,)](o_part, lse_part, o, lse, splits,
                             HS=hs, SPLITS_PAD=max(2, triton.next_power_of_2(splits)))
    return o, lse
