"""A decoder layer's small operations on the CPU in one native call each (native/layer_ops.h): the
RMSNorm (with the residual add before it) and RoPE in place.

At one token each is a few µs of arithmetic, while the torch ops they replace cost µs of dispatch
apiece (a norm alone is six ops, a RoPE five): on a CPU-only decode of a small model that dispatch
outweighed the weight products. The GPU has its own kernels for these (rmsnorm_gpu, rope_gpu); this
module is their CPU counterpart, for fp32 tensors on the CPU with the native extension built;
anything else keeps the torch ops, which compute the same.
"""

from __future__ import annotations

import torch

from engine.kernels import native


def _ops():
    nat = native.module()  # cached import
    return nat if nat is not None and hasattr(nat, "rms_norm") else None


def available(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is fp32 on the CPU and the native operations are built."""
    for t in tensors:  # a loop, not all(…): this runs a few times a layer at every decode step
        if not t.is_cpu or t.dtype != torch.float32:
            return False
    return _ops() is not None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w ⊙ x / √(mean(x²) + eps) over the last dim; x (…, D) fp32, w (D,) fp32 contiguous."""
    D = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty_like(x)
    _ops().rms_norm(x.data_ptr(), D, w.data_ptr(), out.data_ptr(), D, x.numel() // D, D, eps, native.threads())
    return out


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, its RMSNorm); x, r (…, D) fp32 of one shape."""
    D = x.shape[-1]
    x, r = x.contiguous(), r.contiguous()
    h, out = torch.empty_like(x), torch.empty_like(x)
    _ops().add_rms_norm(x.data_ptr(), r.data_ptr(), w.data_ptr(), h.data_ptr(), out.data_ptr(), x.numel() // D, D,
                        eps, native.threads())
    return h, out


def rope_fits(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether rope_ takes x (B, T, nh, hs) and cos (B, 1, T, rd) as they are laid out: heads
    contiguous in each token, tokens evenly spaced (a projection's output or a column slice of it)."""
    B, T, nh, hs = x.shape
    return (x.stride(3) == 1 and x.stride(2) == hs and (B == 1 or x.stride(0) == T * x.stride(1))
            and cos.is_contiguous() and cos.shape[-1] <= hs and cos.shape[-1] % 2 == 0)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half) on the first rd dims of each head of x (B, T, nh, hs), in place (see
    rope_fits); cos, sin (B, 1, T, rd) contiguous. Returns x."""
    B, T, nh, hs = x.shape
    _ops().rope_rotate_half(x.data_ptr(), B * T, x.stride(1), nh, hs, cos.shape[-1], cos.data_ptr(),
                            sin.contiguous().data_ptr(), native.threads())
    return x
