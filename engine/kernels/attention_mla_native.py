"""MLA decode (engine/kernels/attention_mla.py's absorbed form) over latent rows read in place on the
CPU, with its natural-log LSE: the CPU share of the hybrid latent KV (engine/kv/latent.py).

    attend_latent_blocks(q, blocks, value_dim, scale) -> (o, lse)

    q       (B, nh, T, 2w) absorbed queries, fp32 / bf16 / fp16
    blocks  B lists of (k, v) plane views, each (1, t, w): a row = [k | v] (the hybrid format's K and V
            planes of one KV head), any token strides, unit stride along w — or a KVBlockTable of them
            built once (prepare) and reused while the views stay where they are
    →       o (B, nh, T, value_dim) fp32, lse (B, nh, T) fp32: ln Σ exp(scale · q·row); a sequence
            without rows gets o 0 and lse −inf (weight zero in a merge)

Values are the row's first value_dim (r ≤ 2w) columns. Every head reads the same rows, so the native
kernel (native/attention_mla_kernel.h) loads each row once for all nh·T query rows. Without the
extension, or for views whose last dim is not unit-stride, the torch path runs
attention_mla.latent_attention_planes per view and merges the views by LSE: the same result.
"""

from __future__ import annotations

import math

import torch

from engine.errors import KernelInputError
from engine.kernels import attention_mla, native
from engine.kernels.attention_native import KVBlockTable
from engine.kernels.lse import merge_pair

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    """The native MLA kernel is built into the loaded extension."""
    m = native.module()
    return m is not None and hasattr(m, "attention_mla_decode")


def prepare(blocks: list[list[tuple[torch.Tensor, torch.Tensor]]]):
    """The views as the native kernel reads them (a KVBlockTable, one int64 row per view), or the lists
    as they are when the torch path will serve them. The views' memory must stay put while it is used."""
    if not available() or not any(views for views in blocks):
        return blocks
    return KVBlockTable.from_blocks([[k for k, _ in views] for views in blocks],
                                    [[v for _, v in views] for views in blocks])


def runs_natively(blocks) -> bool:
    """What attend_latent_blocks will run for these (prepared) blocks: the native kernel or torch."""
    return isinstance(blocks, KVBlockTable) and blocks.unit_stride and available()


def _output(buf: torch.Tensor | None, shape: tuple, name: str) -> torch.Tensor:
    if buf is None:
        return torch.empty(shape, dtype=torch.float32)
    if buf.dtype != torch.float32 or tuple(buf.shape) != shape or not buf.is_contiguous() or buf.device.type != "cpu":
        raise KernelInputError(f"{name} must be a contiguous fp32 CPU tensor of shape {shape}, "
                               f"got {buf.dtype} {tuple(buf.shape)} on {buf.device}")
    return buf


def attend_latent_blocks(q: torch.Tensor, blocks, value_dim: int, scale: float, *,
                         out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                         threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. `out`, `lse` (contiguous fp32 of the result's shapes, e.g. views of a
    page-locked buffer) receive the result when given."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.device.type != "cpu" or q.dtype not in _DTYPES:
        raise KernelInputError("q must be an fp32/bf16/fp16 CPU tensor (B, nh, T, 2·w)")
    B, nh, T, D = q.shape
    if D % 2 or not 1 <= value_dim <= D:
        raise KernelInputError(f"a row of {D} columns does not hold two planes and {value_dim} values")
    w = D // 2
    table = blocks if isinstance(blocks, KVBlockTable) else None
    if table is None:
        if len(blocks) != B:
            raise KernelInputError(f"q has {B} sequences but blocks {len(blocks)}")
        if any(views for views in blocks) and available():
            table = prepare(blocks)
    if table is not None and (table.batch_size != B or table.n_kv_heads != 1 or table.head_dim != w):
        raise KernelInputError(f"q {tuple(q.shape)} does not fit {table.batch_size} sequences of planes "
                               f"({table.n_kv_heads}, ·, {table.head_dim})")
    out = _output(out, (B, nh, T, value_dim), "out")
    lse = _output(lse, (B, nh, T), "lse")
    if runs_natively(table):
        q4 = q if q.stride(3) == 1 else q.contiguous()  # queries are small; rows are never copied
        sb, sh, st, _ = q4.stride()
        codes = native.DTYPE_CODES
        native.module().attention_mla_decode(q4.data_ptr(), codes[q4.dtype], B, T, nh, w, value_dim, sb, sh, st,
                                             table.rows.data_ptr(), table.seq_offsets.data_ptr(),
                                             codes[table.dtype], float(scale), out.data_ptr(), lse.data_ptr(),
                                             threads or native.threads())
        return out, lse
    views = [list(zip(*table.views(b))) for b in range(B)] if table is not None else blocks
    attend_latent_torch(q, views, value_dim, scale, out, lse)
    return out, lse


def attend_latent_torch(q: torch.Tensor, blocks, value_dim: int, scale: float, out: torch.Tensor,
                        lse: torch.Tensor) -> None:
    """The fallback: each view through latent_attention_planes, merged per sequence by LSE."""
    out.zero_()
    lse.fill_(-math.inf)
    for b, views in enumerate(blocks):
        o, l = out[b:b + 1], lse[b:b + 1]
        for k, v in views:  # (1, t, w) each: one run of rows
            if k.shape[1] == 0:
                continue
            part = attention_mla.latent_attention_planes(q[b:b + 1], k.unsqueeze(0), v.unsqueeze(0), value_dim, scale)
            o, l = merge_pair(o, l, *part)
        out[b:b + 1], lse[b:b + 1] = o, l
