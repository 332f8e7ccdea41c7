"""RMSNorm as one GPU kernel: in torch ops it is eight kernels (cast, pow, mean, add, rsqrt, mul, cast,
mul) for each of the 4 norms of a Qwen3 layer, ~0.5 ms of an 8K decode step's 3.5 ms of kernels on
an H200.

The rounding is the reference's (engine/models/common.py RMSNorm): normalise in fp32, round to the
activations' dtype, then multiply by the weight in that dtype. Only the fp32 sum of squares is
added up in another order.

    rms_norm(x, weight, eps) -> y      x (..., n) with a contiguous last dim; weight (n,); y like x
    add_rms_norm(x, r, weight, eps) -> (x + r, rms_norm(x + r))    one kernel for a residual line and
                                       the norm after it (a kernel fewer in every decode layer)
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Compiled on CUDA only (the interpreter runs it in tests when asked explicitly)."""
    return (triton is not None and x.is_cuda and x.dtype == weight.dtype and x.stride(-1) == 1
            and x.is_contiguous())


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, h_ptr, y_ptr, n, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
        """y = rms_norm(x), or with ADD: h = x + r (rounded as x + r is) and y = rms_norm(h)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n
        x = tl.load(x_ptr + row * n + cols, mask=ok, other=0.0)
        if ADD:
            r = tl.load(r_ptr + row * n + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(h_ptr + row * n + cols, x, mask=ok)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
        normed = (xf * inv).to(x.dtype).to(tl.float32)  # the reference rounds before the weight
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n + cols, (normed * w).to(x.dtype), mask=ok)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + r and y = rms_norm(h) in one kernel (a residual line and the next norm) → (h, y)."""
    n = x.shape[-1]
    assert x.is_contiguous() and r.is_contiguous() and r.shape == x.shape and weight.shape == (n,)
    h, y = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // n if n else 0
    if rows:
        _rms_norm_kernel[(rows,)](x, r, weight, h, y, n, eps, ADD=True, BLOCK=triton.next_power_of_2(n))
    return h, y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    assert x.is_contiguous() and weight.shape == (n,), "x must be contiguous with weight (n,)"
    y = torch.empty_like(x)
    rows = x.numel() // n if n else 0
    if rows:
        _rms_norm_kernel[(rows,)](x, x, weight, y, y, n, eps, ADD=False, BLOCK=triton.next_power_of_2(n))
    return y
