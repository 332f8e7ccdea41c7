"""Multi-head latent attention (DeepSeek-V2's MLA) in the absorbed form, with its log-sum-exp.

MLA caches one row per token, shared by every head: the compressed latent c (r = kv_lora_rank
columns) followed by the RoPE key k_r (dr = qk_rope_head_dim). Head h's key and value are
expansions of the latent through the two halves of kv_b_proj, W_UK_h (dn, r) and W_UV_h (dv, r):

    k_h,t = [W_UK_h c_t, k_r,t]      v_h,t = W_UV_h c_t

so a score and an output can be computed without expanding any cached token:

    q_h · k_h,t = [W_UK_hᵀ q_nope,h, q_rope,h] · [c_t, k_r,t]      (absorb_queries: once per query)
    Σ_t p_t v_h,t = W_UV_h (Σ_t p_t c_t)                           (expand_values: once per query)

`latent_attention` is then plain attention of every head against one key row of width r + dr per
token whose values are the row's first r columns (multi-query attention with V inside K). It returns
the natural-log LSE of each (head, query), so partial results over disjoint key sets (WriteScope's
sequence split: D-window, streamed pinned blocks, the CPU's share) merge exactly through
engine/kernels/lse.py. Pure compute on tensors; no placement.
"""

from __future__ import annotations

import torch


def kv_b_halves(kv_b_weight: torch.Tensor, n_heads: int, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight (nh·(dn + dv), r) → W_UK (nh, dn, r), W_UV (nh, dv, r): views, no copy."""
    per_head = kv_b_weight.view(n_heads, -1, kv_b_weight.shape[-1])  # (nh, dn + dv, r)
    return per_head[:, :nope_dim], per_head[:, nope_dim:]


def absorb_queries(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope (B, nh, T, dn), W_UK (nh, dn, r) → the queries in latent space (B, nh, T, r)."""
    return torch.matmul(q_nope, w_uk)  # (B, nh, T, dn) @ (nh, dn, r), broadcast over B


def expand_values(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Attended latents (B, nh, T, r), W_UV (nh, dv, r) → per-head values (B, nh, T, dv)."""
    return torch.matmul(o_latent, w_uv.transpose(-1, -2))


def latent_attention(q: torch.Tensor, rows: torch.Tensor, value_dim: int, scale: float,
                     mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of absorbed queries over latent rows, in fp32.

    q: (B, nh, T, r + dr) absorbed queries; rows: (B, S, r + dr) cached [latent, RoPE key] rows (any
    strides: a view of a cache region is read in place); value_dim: r. mask: bool, broadcastable to
    (B, nh, T, S), True where a key is visible; None: every key is.
    → o (B, nh, T, r) fp32, lse (B, nh, T) fp32. A (head, query) that sees no key gets o = 0 and
    lse = −inf: weight 0 in a merge.

    The scores of one step are materialised, (B, nh, T, S) fp32: meant for decode (T = 1, a few MB at
    32K keys); a prefill over many queries should go through a fused SDPA instead.
    """
    return latent_attention_planes(q, rows.unsqueeze(1), None, value_dim, scale, mask)


def latent_attention_planes(q: torch.Tensor, first: torch.Tensor, second: torch.Tensor | None, value_dim: int,
                            scale: float, mask: torch.Tensor | None = None, causal: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`latent_attention` over rows kept as two planes, row = [first | second], each (B, 1, S, w_i):
    how the hybrid KV format holds a latent row (its K and V planes of (r + dr)/2 columns each), read
    in place. second None: the whole row is `first`. causal: query i of T sees keys ≤ S − T + i
    (the new tokens of a prefill over themselves). Shapes and results as `latent_attention`."""
    w = first.shape[-1]
    qf = q.float()
    planes = [(qf[..., :w], first.float())]  # (B, nh, T, w), (B, 1, S, w)
    if second is not None and second.shape[-1]:
        planes.append((qf[..., w:], second.float()))
    scores = sum(torch.matmul(qp, kp.transpose(-1, -2)) for qp, kp in planes) * scale  # (B, nh, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if causal:
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones((T, S), dtype=torch.bool, device=q.device).triu(1 + S - T),
                                    float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, nh, T)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # no key: exp(−inf − 0) = 0
    probs = torch.exp(scores - finite.unsqueeze(-1))  # (B, nh, T, S)
    o = torch.matmul(probs, planes[0][1][..., :value_dim])  # (B, nh, T, min(r, w))
    if value_dim > w:  # the latent continues into the second plane
        o = torch.cat((o, torch.matmul(probs, planes[1][1][..., :value_dim - w])), dim=-1)
    return o, lse  # (B, nh, T, r), (B, nh, T)
