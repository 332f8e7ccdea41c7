"""Rotary position embedding as one GPU kernel per tensor: the reference (engine/models/common.py
apply_rope: slice, negate, concatenate, two products, a sum) is six kernels for q and six for k in
every layer of a decode step.

The rounding asked for is the reference's: x·cos and rotate_half(x)·sin each rounded to the
activations' dtype, then added. Triton may keep the products in fp32 up to the sum (it does on an
H200), so an element can differ from the reference by one bf16 step
(tests/kernels/test_rope_route_gpu.py).

    rope(x, cos, sin) -> y      x (B, T, n_heads, hs) contiguous; cos, sin (B, 1, T, hs) contiguous
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def available(x: torch.Tensor, cos: torch.Tensor) -> bool:
    return (triton is not None and x.is_cuda and x.is_contiguous() and cos.is_contiguous()
            and x.dtype == cos.dtype and x.shape[-1] % 2 == 0)


if triton is not None:

    @triton.jit
    def rope_heads(src_ptr, dst_ptr, w_ptr, cos_ptr, sin_ptr, row, src_row, n_heads, hs, eps,
                   NORM: tl.constexpr, ROPE: tl.constexpr, HEADS: tl.constexpr, HS: tl.constexpr, dst_row=None):
        """One token's n_heads heads of hs, from src (row stride src_row elements) to dst (contiguous
        heads; row dst_row of dst, `row` where None: a KV cache's slot takes another index than the
        token's): with NORM each head RMS-normalised over hs with weight w (the reference's rounding,
        engine/kernels/rmsnorm_gpu.py), then with ROPE rotated. Also used by qkv_rope_gpu."""
        h = tl.arange(0, HEADS)
        d = tl.arange(0, HS)
        ok = (h < n_heads)[:, None] & (d < hs)[None, :]
        src = src_ptr + row * src_row + h[:, None] * hs
        x = tl.load(src + d[None, :], mask=ok, other=0.0)  # (HEADS, HS)
        dtype = x.dtype
        half = hs // 2
        if ROPE:
            partner = tl.where(d < half, d + half, d - half)  # rotate_half: (−x₂, x₁)
            xr = tl.load(src + partner[None, :], mask=ok, other=0.0)
        if NORM:  # per head over hs; the partner's element is normalised by its own head's factor
            xf = x.to(tl.float32)
            inv = tl.rsqrt(tl.sum(xf * xf, 1) / hs + eps)  # (HEADS,)
            w = tl.load(w_ptr + d, mask=d < hs, other=0.0).to(tl.float32)
            x = ((xf * inv[:, None]).to(dtype).to(tl.float32) * w[None, :]).to(dtype)
            if ROPE:
                wr = tl.load(w_ptr + partner, mask=d < hs, other=0.0).to(tl.float32)
                xr = ((xr.to(tl.float32) * inv[:, None]).to(dtype).to(tl.float32) * wr[None, :]).to(dtype)
        if ROPE:
            sign = tl.where(d < half, -1.0, 1.0)
            c = tl.load(cos_ptr + row * hs + d, mask=d < hs, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + row * hs + d, mask=d < hs, other=0.0).to(tl.float32)
            a = (x.to(tl.float32) * c[None, :]).to(dtype).to(tl.float32)
            b = (xr.to(tl.float32) * sign[None, :] * s[None, :]).to(dtype).to(tl.float32)
            x = (a + b).to(dtype)
        out_row = row if dst_row is None else dst_row
        tl.store(dst_ptr + out_row * n_heads * hs + h[:, None] * hs + d[None, :], x, mask=ok)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, n_heads, hs, HEADS: tl.constexpr, HS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # one token: b · T + t
        rope_heads(x_ptr, y_ptr, cos_ptr, cos_ptr, sin_ptr, row, n_heads * hs, n_heads, hs, 0.0,
                   False, True, HEADS, HS)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    B, T, n_heads, hs = x.shape
    assert cos.shape == (B, 1, T, hs) and sin.shape == cos.shape
    y = torch.empty_like(x)
    if B * T:
        _rope_kernel[(B * T,)](x, cos, sin, y, n_heads, hs, HEADS=triton.next_power_of_2(n_heads), HS=triton.next_power_of_2(hs))
    return y
