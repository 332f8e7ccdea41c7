"""The decode-attention kernels calibration times, as injectable callables.

An AttentionKernel is `kernel(q, k, v, scale) -> (out, lse)`:
    q (B, nh, 1, hs); k, v (B, n_kv, L, hs) with nh a multiple of n_kv (GQA by fewer KV heads)
    out (B, nh, 1, hs) in q's dtype; lse (B, nh, 1) float32, natural log.
Those are the two halves of split decode attention (CPU part and GPU part, merged by LSE). On the
CPU calibration times the kernel the engine's KV split runs (ENGINE_CPU: engine/kernels/attention_cpu.py,
the native kernel where it is built); on the GPU torch's flash attention. Others are timed by passing them in.
`pick()` checks a candidate against the exact reference on a small input before it is timed, so a
kernel that fails or disagrees on this machine is replaced by the reference and the profile says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.kernels import attention_cpu

AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class NamedKernel:
    name: str  # recorded in the profile next to the costs it produced
    fn: AttentionKernel


def reference_attention(q, k, v, scale):
    """Exact attention with LSE by plain matmuls in float32 (any device, any dtype)."""
    B, nh, _, hs = q.shape
    n_kv = k.shape[1]
    qg = q.float().reshape(B, n_kv, nh // n_kv, hs)  # (B, n_kv, g, hs): query heads grouped by KV head
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # (B, n_kv, g, L)
    lse = torch.logsumexp(scores, dim=-1)  # (B, n_kv, g)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float())  # (B, n_kv, g, hs)
    return out.reshape(B, nh, 1, hs).to(q.dtype), lse.reshape(B, nh, 1)


def torch_cuda_flash(q, k, v, scale):
    """torch's CUDA flash attention (bf16/fp16), which returns the LSE as its second output."""
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    return res[0], res[1].reshape(q.shape[0], q.shape[1], 1)


def engine_cpu_attention(q, k, v, scale):
    """The CPU kernel the engine's KV split runs (attention_cpu.attend_blocks), one view per sequence;
    attention_cpu.kernel_name says which it is for a shape."""
    out, lse = attention_cpu.attend_blocks(q, [[(k[b], v[b])] for b in range(q.shape[0])], scale)
    return out.to(q.dtype), lse


ENGINE_CPU = NamedKernel("engine", engine_cpu_attention)
DEFAULT_GPU = NamedKernel("torch-flash-cuda", torch_cuda_flash)
REFERENCE = NamedKernel("torch-matmul-reference", reference_attention)


def pick(candidate: NamedKernel, n_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
         device: torch.device) -> tuple[NamedKernel, str | None]:
    """`candidate` if it runs and matches the reference on this device and shape; else the reference
    and the reason."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(2, n_heads, 1, head_dim, generator=g).to(device, dtype)
    k = torch.randn(2, n_kv_heads, 300, head_dim, generator=g).to(device, dtype)
    v = torch.randn(2, n_kv_heads, 300, head_dim, generator=g).to(device, dtype)
    scale = head_dim ** -0.5
    try:
        out, lse = candidate.fn(q, k, v, scale)
    except Exception as e:  # an unsupported dtype, GQA layout or device for this build
        return REFERENCE, f"{candidate.name} failed here ({type(e).__name__}: {str(e)[:200]})"
    ref_out, ref_lse = reference_attention(q, k, v, scale)
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    if (out.shape != ref_out.shape or tuple(lse.shape) != tuple(ref_lse.shape)
            or (out.float() - ref_out.float()).abs().max().item() > tol
            or (lse.float() - ref_lse).abs().max().item() > tol):
        return REFERENCE, f"{candidate.name} disagrees with the reference attention here"
    return candidate, None
