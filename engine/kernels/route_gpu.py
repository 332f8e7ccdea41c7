"""Softmax → top-k → renormalise as one GPU kernel (Qwen3-MoE, OLMoE, Mixtral routing): torch runs
it as a cast, a softmax, a sort-based top-k of two kernels, a sum, a division and a cast, every
layer of a decode step.

One program per token: the router logits in fp32, softmax, then k rounds of "take the largest,
lowest index first" (torch.topk's order for distinct values). Weights come out in fp32, as the
reference's, for the caller to cast.

    softmax_topk(logits, k, renormalise) -> (weights (N, k) fp32, ids (N, k) int64)
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def available(logits: torch.Tensor) -> bool:
    return triton is not None and logits.is_cuda and logits.dim() == 2 and logits.is_contiguous()


if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, w_ptr, ids_ptr, n_experts, k, RENORMALISE: tl.constexpr, E: tl.constexpr,
                      K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, E)
        ok = e < n_experts
        x = tl.load(logits_ptr + row * n_experts + e, mask=ok, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, 0))
        p = tl.where(ok, p / tl.sum(p, 0), -1.0)  # (E,) softmax; padding −1, never chosen
        j = tl.arange(0, K)
        weights = tl.zeros((K,), tl.float32)
        ids = tl.zeros((K,), tl.int64)
        for r in range(0, k):  # each round takes the largest left, lowest index first, and removes it
            best = tl.max(p, 0)
            idx = tl.min(tl.where(p == best, e, E), 0)
            weights = tl.where(j == r, best, weights)
            ids = tl.where(j == r, idx.to(tl.int64), ids)
            p = tl.where(e == idx, -1.0, p)
        if RENORMALISE:
            weights = weights / tl.sum(weights, 0)
        tl.store(w_ptr + row * k + j, weights, mask=j < k)
        tl.store(ids_ptr + row * k + j, ids, mask=j < k)


def softmax_topk(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    N, n_experts = logits.shape
    weights = torch.empty((N, k), device=logits.device, dtype=torch.float32)
    ids = torch.empty((N, k), device=logits.device, dtype=torch.int64)
    if N:
        _route_kernel[(N,)](logits, weights, ids, n_experts, k, RENORMALISE=renormalise,
                            E=triton.next_power_of_2(n_experts), K=triton.next_power_of_2(k))
    return weights, ids
