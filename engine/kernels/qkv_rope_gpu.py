"""q, k and v out of one fused projection, with per-head RMSNorm and RoPE on q and k, as one GPU kernel.

Unfused, a decode layer runs three projections, then q_norm, k_norm, rope(q) and rope(k): seven
kernels where the work is a few hundred KB, so each costs about its launch. Here the projection is one GEMM over the
concatenated weights (`Attention.fuse_qkv`) and this kernel does the rest: two kernels a layer. With
the norm fusions beside it a decode layer is 18 kernels instead of 28, about 1 ms off a 48-layer
decode step at 2K, bs=1, on an H200 (resident decode of 16 layers: 17% faster).

The rounding is the reference's (engine/models/common.py): the norm normalises in fp32, rounds to the
activations' dtype and multiplies by the weight in that dtype; RoPE rounds x·cos and rotate_half(x)·sin
to the dtype and adds them; both are rope_gpu.rope_heads, which rope() uses too.

    qk_norm_rope(qkv, n_heads, n_kv_heads, cos, sin, q_weight, k_weight, eps, store=None) -> q, k, v
        qkv (B, T, (nh + 2·n_kv)·hs) contiguous, q first, then k, then v; cos, sin (B, 1, T, hs)
        contiguous; q_weight, k_weight (hs,) or None (no norm) → q (B, T, nh, hs), k, v (B, T, n_kv, hs)
        store: (k_cache, v_cache (slots, n_kv, hs) contiguous, rows (B·T,) int64 on the device): k and v
        are written to their cache rows instead (a decode step's KV store, two kernels fewer a layer)
        and come back None.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from engine.kernels.rope_gpu import rope_heads  # the per-head norm and rotation, shared with rope()
except ImportError:
    triton = None


def available(qkv: torch.Tensor, cos: torch.Tensor) -> bool:
    """Compiled on CUDA only (the interpreter runs it in tests when asked explicitly)."""
    return (triton is not None and qkv.is_cuda and qkv.is_contiguous() and cos.is_contiguous()
            and qkv.dtype == cos.dtype)


if triton is not None:

    @triton.jit
    def _qkv_kernel(qkv_ptr, q_ptr, k_ptr, v_ptr, rows_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, n_heads, n_kv, hs,
                    eps, NORM: tl.constexpr, STORE: tl.constexpr, Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                    HS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # one token: b · T + t
        src_row = (n_heads + 2 * n_kv) * hs
        kv_row = tl.load(rows_ptr + row) if STORE else row  # with STORE k_ptr, v_ptr are the caches
        rope_heads(qkv_ptr, q_ptr, qw_ptr, cos_ptr, sin_ptr, row, src_row, n_heads, hs, eps, NORM, True, Q_HEADS, HS)
        rope_heads(qkv_ptr + n_heads * hs, k_ptr, kw_ptr, cos_ptr, sin_ptr, row, src_row, n_kv, hs, eps,
                   NORM, True, KV_HEADS, HS, kv_row)
        rope_heads(qkv_ptr + (n_heads + n_kv) * hs, v_ptr, kw_ptr, cos_ptr, sin_ptr, row, src_row, n_kv, hs, eps,
                   False, False, KV_HEADS, HS, kv_row)  # v: copied out as it is


def qk_norm_rope(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, store=None):
    B, T, width = qkv.shape
    hs = width // (n_heads + 2 * n_kv_heads)
    assert width == (n_heads + 2 * n_kv_heads) * hs and hs % 2 == 0, "qkv: (B, T, (nh + 2·n_kv)·hs)"
    assert cos.shape == (B, 1, T, hs) and sin.shape == cos.shape and qkv.is_contiguous() and cos.is_contiguous()
    norm = q_weight is not None
    assert norm == (k_weight is not None) and (not norm or q_weight.shape == k_weight.shape == (hs,))
    q = qkv.new_empty(B, T, n_heads, hs)
    if store is None:
        k = qkv.new_empty(B, T, n_kv_heads, hs)
        v = qkv.new_empty(B, T, n_kv_heads, hs)
        rows = k  # any pointer stands in when unused
    else:
        k, v, rows = store
        assert k.shape[1:] == v.shape[1:] == (n_kv_heads, hs) and k.is_contiguous() and v.is_contiguous()
        assert rows.shape == (B * T,) and rows.dtype == torch.int64 and rows.device == qkv.device
    if B * T:
        qw, kw = (q_weight, k_weight) if norm else (cos, cos)  # any pointer stands in when unused
        _qkv_kernel[(B * T,)](qkv, q, k, v, rows, qw, kw, cos, sin, n_heads, n_kv_heads, hs, eps, NORM=norm,
                              STORE=store is not None, Q_HEADS=triton.next_power_of_2(n_heads),
                              KV_HEADS=triton.next_power_of_2(n_kv_heads), HS=triton.next_power_of_2(hs))
    return (q, k, v) if store is None else (q, None, None)
