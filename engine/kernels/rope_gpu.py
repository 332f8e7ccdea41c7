"""Rotary position embedding as one GPU kernel per tensor: the reference (engine/models/common.py
apply_rope: slice, negate, concatenate, two products, a sum) is six kernels for q and six for k in
every layer of a decode step.

The rounding asked for is the reference's: x·cos and rotate_half(x)·sin each rounded to the
activations' dtype, then added. On the H200 Triton kept the products in fp32 up to the sum, so an
element can differ from the reference by one bf16 step (tests/kernels/test_rope_route_gpu.py).

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
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, n_heads, hs, half,
                     HEADS: tl.constexpr, HS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # one token: b · T + t
        h = tl.arange(0, HEADS)
        d = tl.arange(0, HS)
        ok = (h < n_heads)[:, None] & (d < hs)[None, :]
        base = row * n_heads * hs
        x = tl.load(x_ptr + base + h[:, None] * hs + d[None, :], mask=ok, other=0.0)  # (HEADS, HS)
        partner = tl.where(d < half, d + half, d - half)  # rotate_half: (−x₂, x₁)
        xr = tl.load(x_ptr + base + h[:, None] * hs + partner[None, :], mask=ok, other=0.0)
        sign = tl.where(d < half, -1.0, 1.0)
        c = tl.load(cos_ptr + row * hs + d, mask=d < hs, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + row * hs + d, mask=d < hs, other=0.0).to(tl.float32)
        dtype = x.dtype
        a = (x.to(tl.float32) * c[None, :]).to(dtype).to(tl.float32)
        b = (xr.to(tl.float32) * sign[None, :] * s[None, :]).to(dtype).to(tl.float32)
        tl.store(y_ptr + base + h[:, None] * hs + d[None, :], (a + b).to(dtype), mask=ok)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    B, T, n_heads, hs = x.shape
    assert cos.shape == (B, 1, T, hs) and sin.shape == cos.shape
    y = torch.empty_like(x)
    if B * T:
        _rope_kernel[(B * T,)](x, cos, sin, y, n_heads, hs, hs // 2,
                               HEADS=triton.next_power_of_2(n_heads), HS=triton.next_power_of_2(hs))
    return y
