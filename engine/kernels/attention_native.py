"""Exact decode attention over KV blocks on the CPU, returning the output *and* its log-sum-exp.

The CPU half of WriteScope's hybrid attention (seed 000, §4.3, §6.1): the unpinned compute region's
blocks are read in place — zero copy, each view walked through its own strides — and the partial
result travels to the GPU with its natural-log LSE, where the parts merge exactly:
    m = max(lse₁, lse₂);  out = (o₁·e^(lse₁−m) + o₂·e^(lse₂−m)) / (e^(lse₁−m) + e^(lse₂−m))

    attend_blocks(q, k_blocks, v_blocks, scale=None) -> (out, lse)

    q (n_heads, hs)          one sequence, one query;  k_blocks, v_blocks: lists of (n_kv, t_i, hs) views
    q (B, n_heads, hs)       B sequences, one query each;  k_blocks, v_blocks: B such lists
    q (B, n_heads, T, hs)    B sequences, T queries each (as KVBackend.attend passes q); every query
                             sees every key of its sequence: the blocks hold only the past, no mask
    k_blocks may instead be a KVBlockTable (built once per step, e.g. from a block pool; v_blocks None).

    out: fp32, q's shape.  lse: fp32, q's shape without head_dim: ln Σ_keys exp(scale · q·k).
    A sequence without keys gives out 0 and lse −inf (weight zero in the merge).

Query head h reads KV head h // (n_heads / n_kv) (GQA as transformers' repeat_kv). KV dtypes fp32,
bf16, fp16 (one dtype for all blocks), fp32 accumulation; q fp32, bf16 or fp16. Head dims that are
multiples of 16 up to 256 run natively; others, views whose head_dim is not unit-stride, or a missing
extension run the torch fallback below, which computes the same thing (gathering a copy).
Sliding windows: pass views sliced to the window (k[:, a:b] is still zero copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from engine.errors import KernelInputError
from engine.kernels import native

_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def implementation() -> str:
    """Which kernel attend_blocks runs: 'native-<isa>' or 'torch' (for StatsSnapshot's `kernels`)."""
    isa = native.isa()
    return f"native-{isa}" if isa else "torch"


def native_head_dim(head_dim: int) -> bool:
    """Head dims the native kernel takes; others run the torch path."""
    return head_dim % 16 == 0 and 16 <= head_dim <= 256


@dataclass(frozen=True)
class KVBlockTable:
    """B sequences' KV blocks as the native kernel reads them: one int64 row per non-empty block,
    (k_ptr, v_ptr, n_tokens, k_stride_head, k_stride_token, v_stride_head, v_stride_token), strides
    in elements. It holds the tensors it points into, so they outlive any call that uses it."""

    rows: torch.Tensor  # (n_blocks, 7) int64
    seq_offsets: torch.Tensor  # (B + 1,) int64: sequence b owns rows [seq_offsets[b], seq_offsets[b+1])
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    unit_stride: bool  # head_dim contiguous in every view (the native kernel's one layout demand)
    views: Callable[[int], tuple[list[torch.Tensor], list[torch.Tensor]]]  # sequence b's (k, v) views
    keepalive: tuple = ()

    @property
    def batch_size(self) -> int:
        return self.seq_offsets.numel() - 1

    @classmethod
    def from_blocks(cls, k_blocks: Sequence[Sequence[torch.Tensor]], v_blocks: Sequence[Sequence[torch.Tensor]],
                    *, n_kv_heads: int | None = None, head_dim: int | None = None,
                    dtype: torch.dtype | None = None) -> KVBlockTable:
        """k_blocks[b], v_blocks[b]: sequence b's K and V views, each (n_kv, t_i, hs), in token order."""
        if len(k_blocks) != len(v_blocks):
            raise KernelInputError(f"{len(k_blocks)} sequences of K blocks but {len(v_blocks)} of V blocks")
        rows, offsets, unit, first = [], [0], True, None
        for b, (ks, vs) in enumerate(zip(k_blocks, v_blocks)):
            if len(ks) != len(vs):
                raise KernelInputError(f"sequence {b}: {len(ks)} K blocks but {len(vs)} V blocks")
            for k, v in zip(ks, vs):
                first = k if first is None else first
                _check_block(k, v, n_kv_heads or first.shape[0], head_dim or first.shape[-1], dtype or first.dtype)
                if k.shape[1] == 0:
                    continue
                unit = unit and k.stride(2) == 1 and v.stride(2) == 1
                rows.append((k.data_ptr(), v.data_ptr(), k.shape[1],
                             k.stride(0), k.stride(1), v.stride(0), v.stride(1)))
            offsets.append(len(rows))
        if first is None and (n_kv_heads is None or head_dim is None or dtype is None):
            raise KernelInputError("no KV blocks at all: pass n_kv_heads, head_dim and dtype")
        seqs = [(list(ks), list(vs)) for ks, vs in zip(k_blocks, v_blocks)]
        return cls(rows=torch.tensor(rows, dtype=torch.int64).reshape(-1, 7),
                   seq_offsets=torch.tensor(offsets, dtype=torch.int64),
                   n_kv_heads=n_kv_heads or first.shape[0], head_dim=head_dim or first.shape[-1],
                   dtype=dtype or first.dtype, unit_stride=unit, views=lambda b: seqs[b], keepalive=(seqs,))

    @classmethod
    def from_pool(cls, k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: Sequence[Sequence[int] | torch.Tensor],
                  lengths: Sequence[int], *, block_dim: int = 0) -> KVBlockTable:
        """Blocks of a pool tensor whose dimension `block_dim` numbers the blocks and whose other
        dimensions are (n_kv, block_size, hs), e.g. (N, n_kv, bs, hs) or (n_kv, N, bs, hs) with
        block_dim=1. Sequence b holds lengths[b] tokens in blocks block_ids[b] (the last one partly
        filled). Built with a few vectorised torch ops, whatever the number of blocks."""
        if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype or k_pool.dim() != 4:
            raise KernelInputError(f"K and V pools must be 4-D and alike, got {tuple(k_pool.shape)} {k_pool.dtype} "
                                   f"and {tuple(v_pool.shape)} {v_pool.dtype}")
        if k_pool.device.type != "cpu" or v_pool.device.type != "cpu" or k_pool.dtype not in _KV_DTYPES:
            raise KernelInputError(f"KV pools must be fp32/bf16/fp16 CPU tensors, "
                                   f"got {k_pool.dtype} on {k_pool.device}")
        if len(block_ids) != len(lengths):
            raise KernelInputError(f"{len(block_ids)} block lists but {len(lengths)} lengths")
        n_pool = k_pool.shape[block_dim]
        n_kv, bs, hs = (k_pool.shape[d] for d in range(4) if d != block_dim)
        ids, n_tok, offsets = [], [], [0]
        for b, (blocks, length) in enumerate(zip(block_ids, lengths)):
            need = -(-int(length) // bs)
            blocks = torch.as_tensor(blocks, dtype=torch.int64).flatten()
            if length < 0 or blocks.numel() < need:
                raise KernelInputError(f"sequence {b}: {length} tokens need {need} blocks of {bs}, "
                                       f"got {blocks.numel()}")
            ids.append(blocks[:need])
            n_tok.append(torch.full((need,), bs, dtype=torch.int64))
            if need:
                n_tok[-1][-1] = length - (need - 1) * bs
            offsets.append(offsets[-1] + need)
        ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_pool):
            raise KernelInputError(f"block ids must lie in [0, {n_pool})")
        es = k_pool.element_size()
        k_strides = [k_pool.stride(d) for d in range(4) if d != block_dim]
        v_strides = [v_pool.stride(d) for d in range(4) if d != block_dim]
        rows = torch.stack([
            k_pool.data_ptr() + ids * (k_pool.stride(block_dim) * es),
            v_pool.data_ptr() + ids * (v_pool.stride(block_dim) * es),
            torch.cat(n_tok) if n_tok else ids,
            torch.full_like(ids, k_strides[0]), torch.full_like(ids, k_strides[1]),
            torch.full_like(ids, v_strides[0]), torch.full_like(ids, v_strides[1]),
        ], dim=1)
        bounds = offsets

        def views(b: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            ks, vs = [], []
            for i in range(bounds[b], bounds[b + 1]):
                n = int(rows[i, 2])
                ks.append(k_pool.select(block_dim, int(ids[i]))[:, :n])
                vs.append(v_pool.select(block_dim, int(ids[i]))[:, :n])
            return ks, vs

        return cls(rows=rows.contiguous(), seq_offsets=torch.tensor(offsets, dtype=torch.int64), n_kv_heads=n_kv,
                   head_dim=hs, dtype=k_pool.dtype, unit_stride=k_strides[2] == 1 and v_strides[2] == 1,
                   views=views, keepalive=(k_pool, v_pool))


def _check_block(k: torch.Tensor, v: torch.Tensor, n_kv: int, hs: int, dtype: torch.dtype) -> None:
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise KernelInputError(f"KV blocks must be tensors, got {type(k).__name__} and {type(v).__name__}")
    if k.device.type != "cpu" or v.device.type != "cpu":
        raise KernelInputError(f"KV blocks must be on the CPU, got {k.device} and {v.device}")
    if k.dtype not in _KV_DTYPES or k.dtype != dtype or v.dtype != dtype:
        raise KernelInputError(f"KV blocks must all be one of fp32/bf16/fp16, got {k.dtype} and {v.dtype} "
                               f"(expected {dtype})")
    if k.dim() != 3 or k.shape != v.shape or k.shape[0] != n_kv or k.shape[2] != hs:
        raise KernelInputError(f"K and V blocks must both be (n_kv={n_kv}, tokens, head_dim={hs}), "
                               f"got {tuple(k.shape)} and {tuple(v.shape)}")


def attend_blocks(q: torch.Tensor, k_blocks, v_blocks=None, scale: float | None = None, *,
                  out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                  threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over the KV blocks with its LSE; see the module docstring for the shapes."""
    dim = q.dim() if isinstance(q, torch.Tensor) else 0
    if dim not in (2, 3, 4):
        raise KernelInputError("q must be a tensor of shape (n_heads, hs), (B, n_heads, hs) or (B, n_heads, T, hs)")
    if q.device.type != "cpu" or q.dtype not in _KV_DTYPES:
        raise KernelInputError(f"q must be an fp32/bf16/fp16 CPU tensor, got {q.dtype} on {q.device}")
    q4 = q if dim == 4 else q[:, :, None] if dim == 3 else q[None, :, None]  # (B, nh, T, hs), a view
    B, nh, T, hs = q4.shape
    if isinstance(k_blocks, KVBlockTable):
        table = k_blocks
    else:
        if dim == 2:
            k_blocks, v_blocks = [k_blocks], [v_blocks]
        elif v_blocks is None or len(k_blocks) != B or any(isinstance(k, torch.Tensor) for k in k_blocks):
            raise KernelInputError(f"with q of shape {tuple(q.shape)}, k_blocks and v_blocks must be {B} lists of blocks")
        empty = not any(len(ks) for ks in k_blocks)  # then any head layout fits: outputs are 0, lse −inf
        table = KVBlockTable.from_blocks(k_blocks, v_blocks, n_kv_heads=nh if empty else None, head_dim=hs,
                                         dtype=q.dtype if empty else None)
    if table.seq_offsets.numel() != B + 1 or table.head_dim != hs or nh % table.n_kv_heads:
        raise KernelInputError(f"q {tuple(q.shape)} does not fit KV of {table.batch_size} sequences, "
                               f"{table.n_kv_heads} KV heads of dim {table.head_dim}")
    scale = hs ** -0.5 if scale is None else float(scale)
    out = _output(out, q.shape, "out")
    lse = _output(lse, q.shape[:-1], "lse")
    nat = native.module()
    if nat is not None and table.unit_stride and native_head_dim(hs):
        if q4.stride(3) != 1:
            q4 = q4.contiguous()  # (B, nh, T, hs): queries are small; KV is never copied
        sb, sh, st, _ = q4.stride()
        codes = native.DTYPE_CODES
        nat.attention_decode(q4.data_ptr(), codes[q4.dtype], B, T, nh, hs, sb, sh, st, table.rows.data_ptr(),
                             table.seq_offsets.data_ptr(), table.n_kv_heads, codes[table.dtype], scale,
                             out.data_ptr(), lse.data_ptr(), threads or native.threads())
    else:
        attend_blocks_torch(q4, table, scale, out.view(B, nh, T, hs), lse.view(B, nh, T))
    return out, lse


_ONE_SEQUENCE = np.array([0, 1], dtype=np.int64)  # seq_offsets of a table of one sequence of one block


def attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: slice,
                scale: float) -> torch.Tensor | None:
    """One sequence's attention over rows [start, stop) of a layer's cache, read in place: a resident
    CPU decode step, without attend_blocks' checks and table (they cost more than the attention of a
    short chat). q (1, nh, T, hs) fp32; k_cache, v_cache (slots, n_kv, hs) contiguous; every query sees
    every row. → (1, nh, T, hs) fp32, or None where the native kernel does not take these tensors."""
    nat = native.module()
    _, nh, T, hs = q.shape
    n_kv = k_cache.shape[1]
    if (nat is None or not native_head_dim(hs) or q.dtype != torch.float32 or k_cache.dtype not in _KV_DTYPES
            or v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or q.stride(3) != 1 or nh % n_kv or rows.stop <= rows.start):
        return None
    size = k_cache.element_size()
    # one block: (k address, v address, tokens, head stride, token stride of k, the same of v), in elements
    table = np.array([[k_cache.data_ptr() + rows.start * n_kv * hs * size,
                       v_cache.data_ptr() + rows.start * n_kv * hs * size,
                       rows.stop - rows.start, hs, n_kv * hs, hs, n_kv * hs]], dtype=np.int64)
    out = torch.empty(1, nh, T, hs)
    lse = torch.empty(1, nh, T)
    sb, sh, st, _ = q.stride()
    codes = native.DTYPE_CODES
    nat.attention_decode(q.data_ptr(), codes[q.dtype], 1, T, nh, hs, sb, sh, st, table.ctypes.data,
                         _ONE_SEQUENCE.ctypes.data, n_kv, codes[k_cache.dtype], scale, out.data_ptr(), lse.data_ptr(),
                         native.threads())
    return out


def _output(buf: torch.Tensor | None, shape, name: str) -> torch.Tensor:
    if buf is None:
        return torch.empty(shape, dtype=torch.float32)
    if buf.dtype != torch.float32 or buf.shape != shape or not buf.is_contiguous() or buf.device.type != "cpu":
        raise KernelInputError(f"{name} must be a contiguous fp32 CPU tensor of shape {tuple(shape)}, "
                               f"got {buf.dtype} {tuple(buf.shape)} on {buf.device}")
    return buf


def attend_blocks_torch(q4: torch.Tensor, table: KVBlockTable, scale: float, out4: torch.Tensor,
                        lse3: torch.Tensor) -> None:
    """The fallback: the same result in plain torch (fp32), gathering each sequence's blocks."""
    B, nh, T, hs = q4.shape
    n_kv = table.n_kv_heads
    for b in range(B):
        ks, vs = table.views(b)
        ks = [k for k in ks if k.shape[1]]
        vs = [v for v in vs if v.shape[1]]
        if not ks:
            out4[b].zero_()
            lse3[b].fill_(-math.inf)
            continue
        keys = torch.cat([k.float() for k in ks], dim=1)  # (n_kv, L, hs)
        values = torch.cat([v.float() for v in vs], dim=1)
        queries = q4[b].float().reshape(n_kv, (nh // n_kv) * T, hs)  # rows of KV head g: its q heads × T
        scores = torch.bmm(queries, keys.transpose(1, 2)) * scale  # (n_kv, group·T, L)
        lse3[b] = torch.logsumexp(scores, dim=-1).reshape(nh, T)
        out4[b] = torch.bmm(torch.softmax(scores, dim=-1), values).reshape(nh, T, hs)


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The AttentionKernel interface of engine/hw/attention_kernels.py, for calibration:
    q (B, nh, 1, hs), k, v (B, n_kv, L, hs) → out (B, nh, 1, hs) in q's dtype, lse (B, nh, 1) fp32.
    Each sequence's K and V are read in place as one block."""
    table = KVBlockTable.from_blocks([[k[b]] for b in range(k.shape[0])], [[v[b]] for b in range(v.shape[0])])
    out, lse = attend_blocks(q, table, scale=scale)
    return out.to(q.dtype), lse
