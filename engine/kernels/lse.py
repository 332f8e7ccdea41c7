"""Exact merge of partial attention results by their log-sum-exp.

Attention over a key set K = K1 ∪ K2 (disjoint) splits exactly: with o_i the softmax-weighted
output over K_i and l_i = log Σ_{k∈K_i} exp(q·k·scale) its natural-log normaliser,

    m = max(l1, l2);  w_i = exp(l_i − m)
    o = (o1·w1 + o2·w2) / (w1 + w2);  l = m + log(w1 + w2)

A part with no keys has l = −inf and weight 0. Everything here runs in fp32 on any device.
"""

from __future__ import annotations

import torch


def merge_pair(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """o: (..., hs) fp32, l: (...) fp32 → merged (o (..., hs), l (...))."""
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # both parts empty: keep 0/0 out of it
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)  # (...)
    den = w1 + w2
    safe = torch.where(den > 0, den, torch.ones_like(den))
    out = (o1 * w1.unsqueeze(-1) + o2 * w2.unsqueeze(-1)) / safe.unsqueeze(-1)
    return out, m + torch.log(den)


def merge_groups(outs: torch.Tensor, lses: torch.Tensor, rows: torch.Tensor, n_rows: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P parts into n_rows results; part p belongs to row rows[p].

    outs: (P, nh, T, hs) fp32; lses: (P, nh, T) fp32; rows: (P,) int64 on the same device
    → out (n_rows, nh, T, hs) fp32, lse (n_rows, nh, T) fp32. A fixed number of kernels, whatever P.
    """
    P, nh, T = lses.shape
    index = rows.view(P, 1, 1).expand(P, nh, T)
    m = torch.full((n_rows, nh, T), float("-inf"), device=lses.device, dtype=lses.dtype)
    m = m.scatter_reduce(0, index, lses, reduce="amax", include_self=True)  # (n_rows, nh, T)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m.index_select(0, rows))  # (P, nh, T)
    den = torch.zeros_like(m).index_add_(0, rows, w)  # (n_rows, nh, T)
    num = torch.zeros((n_rows, nh, T, outs.shape[-1]), device=outs.device, dtype=outs.dtype)
    num.index_add_(0, rows, outs * w.unsqueeze(-1))
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return num / safe.unsqueeze(-1), m + torch.log(den)


def merge_stack(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P parts of the same rows: outs (P, ..., hs), lses (P, ...) → (o (..., hs), l (...)).

    At least one part of every row must have keys (a finite LSE); the decode D-window guarantees it.
    """
    m = lses.amax(dim=0)  # (...)
    w = torch.exp(lses - m)  # (P, ...)
    den = w.sum(dim=0)
    return (outs * w.unsqueeze(-1)).sum(dim=0) / den.unsqueeze(-1), m + torch.log(den)
