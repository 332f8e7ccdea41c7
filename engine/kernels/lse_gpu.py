"""The LSE merge of partial attention results (engine/kernels/lse.py) as one GPU kernel.

WriteScope's decode attention for one layer ends with P parts (the D-window, the CPU share, each
streamed chunk), each an output and its natural-log LSE for one sequence row. In torch the merge is
about twenty small kernels, and on a host where a launch costs 20–40 µs that is most of a
bs=1 layer step's overhead. Here it is one launch that also casts to the activations' dtype:

    merge_rows(outs, lses, rows, n_rows, dtype) -> (out, lse)

    outs (P, nh, T, hs) fp32 or bf16/fp16, contiguous;  lses (P, nh, T) fp32, contiguous
    rows (P,) int64 on the device: the sequence row each part belongs to
    out  (n_rows, nh, T, hs) in `dtype`: per row, Σ_p w_p·o_p / Σ_p w_p with w_p = e^(lse_p − max);
         a row whose parts all have lse −inf (no keys) gets 0
    lse  (n_rows, nh, T) fp32: per row, max + ln Σ_p w_p, the merged natural-log LSE (−inf: no keys),
         which attention sinks scale the output by (engine/kv/writescope.py)

The parts are folded in order with a running maximum (the online-softmax rescaling), so P may be
anything; the result equals lse.merge_groups up to fp32 rounding.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def available(outs: torch.Tensor) -> bool:
    return triton is not None and outs.is_cuda


if triton is not None:

    @triton.jit
    def _merge_rows_kernel(outs_ptr, lses_ptr, rows_ptr, out_ptr, lse_out_ptr, n_parts, n_cols, hs,
                           HS: tl.constexpr):
        col = tl.program_id(0).to(tl.int64)  # one (head, query) pair: h · T + t (a prefill has many)
        row = tl.program_id(1)  # the sequence row
        d = tl.arange(0, HS)
        dmask = d < hs
        acc = tl.zeros((HS,), dtype=tl.float32)
        m = tl.full((HS,), float("-inf"), tl.float32)  # running maximum of the folded LSEs (all lanes alike)
        den = tl.zeros((HS,), dtype=tl.float32)
        for p in range(0, n_parts):
            mine = tl.load(rows_ptr + p) == row
            lse = tl.load(lses_ptr + p * n_cols + col)
            lse = tl.where(mine, lse, -float("inf"))  # another row's part weighs nothing
            m_new = tl.maximum(m, lse)
            empty = m_new == -float("inf")  # nothing with keys folded yet: keep 0 / 0 out of it
            alpha = tl.where(empty, 1.0, tl.exp(m - m_new))
            w = tl.where(empty, 0.0, tl.exp(lse - m_new))
            o = tl.load(outs_ptr + (p * n_cols + col) * hs + d, mask=dmask, other=0.0).to(tl.float32)
            acc = acc * alpha + w * o
            den = den * alpha + w
            m = m_new
        res = acc / tl.where(den > 0.0, den, 1.0)
        tl.store(out_ptr + (row * n_cols + col) * hs + d, res.to(out_ptr.dtype.element_ty), mask=dmask)
        lse_out = tl.where(den > 0.0, m + tl.log(tl.where(den > 0.0, den, 1.0)), -float("inf"))  # no keys: −inf
        tl.store(lse_out_ptr + row * n_cols + col, tl.max(lse_out, axis=0))  # lanes alike: any one


def merge_rows(outs: torch.Tensor, lses: torch.Tensor, rows: torch.Tensor, n_rows: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    P, nh, T, hs = outs.shape
    if lses.shape != (P, nh, T) or rows.shape != (P,):
        raise ValueError(f"merge_rows: outs {tuple(outs.shape)}, lses {tuple(lses.shape)} and rows "
                         f"{tuple(rows.shape)} do not agree")
    outs, lses = outs.contiguous(), lses.float().contiguous()
    out = torch.empty((n_rows, nh, T, hs), dtype=dtype, device=outs.device)
    lse = torch.empty((n_rows, nh, T), dtype=torch.float32, device=outs.device)
    if n_rows and nh * T:
        _merge_rows_kernel[(nh * T, n_rows)](outs, lses, rows, out, lse, P, nh * T, hs,
                                             HS=triton.next_power_of_2(hs))
    return out, lse
