"""Multi-head latent attention (DeepSeek-V2, V2-Lite): the attention module and its shape.

    q = q_proj(x)  or  q_b_proj(norm(q_a_proj(x)))           (B, T, nh·(dn + dr)); V2-Lite has no q LoRA
    [c, k_r] = kv_a_proj_with_mqa(x);  c = norm(c)            (B, T, r + dr): one row per token, every head
    q_rope, k_r: RoPE (rotate-half tables of width dr)
    attention in the absorbed form over the cached [c, k_r] rows (engine/kernels/attention_mla.py)
    out = o_proj(W_UV · attended latent)

The KV backend stores one row of r + dr columns per token and layer (kv_lora_rank 512 + rope 64 in
the published models) instead of per-head K and V (16 heads × (192 + 128) in V2-Lite: 8.9× more).
It is handed through the ordinary `kv.attend(layer, q, k, v)`: q are the absorbed query rows
(B, nh, T, r + dr), k the new latent rows as one KV head (B, 1, T, r + dr), and v is None — the
values *are* the first r columns of each key row, so a second copy would only double the cache;
`scale` says the model's softmax scale, which is not (r + dr)^−½. Only a backend that knows K-only
rows accepts this (engine/kv/latent.py: resident rows, or the hybrid format holding each row in its
two planes; engine/kv/latent_monolithic.py: the monolithic comparison policy's buffers of rows).

Checkpoints apply RoPE to interleaved pairs (x0, x1), (x2, x3)…; the engine's tables rotate halves.
q_rope and k_r only ever meet in their dot product, so permuting both the same way is exact:
`deinterleave_rope_rows` reorders the rows of the projections that produce them, once, at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from engine.kernels import attention_mla
from engine.models.common import ModelArgs, RMSNorm, apply_rope

LORA_NORM_EPS = 1e-6  # the reference's q_a/kv_a RMSNorms use their default eps, not rms_norm_eps


@dataclass(frozen=True)
class MLAShape:
    kv_lora_rank: int  # r: width of the cached latent
    qk_nope_head_dim: int  # dn: the part of each head's query/key without position
    qk_rope_head_dim: int  # dr: the RoPE part, one key shared by every head
    v_head_dim: int  # dv
    q_lora_rank: int | None = None  # None: q projected straight from the hidden state (V2-Lite)
    softmax_scale: float = 0.0  # (dn + dr)^−½, times YaRN's mscale² where the config scales RoPE

    @property
    def row_width(self) -> int:
        """Columns of one cached token row: latent, then RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN attention-temperature correction: 0.1·mscale·ln(factor) + 1 (1 when unscaled)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class MLAttention(nn.Module):
    def __init__(self, args: "MLAArgs", layer_idx: int):
        super().__init__()
        m = args.mla
        self.layer_idx, self.n_heads, self.shape = layer_idx, args.n_heads, m
        q_width = args.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(args.dim, m.q_lora_rank, bias=args.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(args.dim, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(args.dim, m.row_width, bias=args.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, args.n_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(args.n_heads * m.v_head_dim, args.dim, bias=args.o_bias)

    def fuse_qkv(self) -> None:
        """Nothing to fuse: the q and latent projections differ in input (q LoRA) and width."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv) -> torch.Tensor:
        B, T, _ = x.shape
        m, nh = self.shape, self.n_heads
        dn, dr = m.qk_nope_head_dim, m.qk_rope_head_dim
        if m.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)  # (B, T, nh·(dn + dr))
        q = q.view(B, T, nh, dn + dr).transpose(1, 2)  # (B, nh, T, dn + dr)
        q_nope, q_rope = q[..., :dn], q[..., dn:]
        row = self.kv_a_proj_with_mqa(x)  # (B, T, r + dr)
        latent = self.kv_a_layernorm(row[..., :m.kv_lora_rank]).unsqueeze(1)  # (B, 1, T, r)
        k_rope = apply_rope(row[..., m.kv_lora_rank:].unsqueeze(1), cos, sin)  # (B, 1, T, dr); cos: (B, 1, T, dr)
        w_uk, w_uv = attention_mla.kv_b_halves(self.kv_b_proj.weight, nh, dn)  # (nh, dn, r), (nh, dv, r)
        q_rows = torch.cat((attention_mla.absorb_queries(q_nope, w_uk), apply_rope(q_rope, cos, sin)), dim=-1)
        k_rows = torch.cat((latent, k_rope), dim=-1)  # (B, 1, T, r + dr): what the cache keeps
        o = kv.attend(self.layer_idx, q_rows, k_rows, None, scale=m.softmax_scale)  # (B, nh, T, r)
        y = attention_mla.expand_values(o, w_uv)  # (B, nh, T, dv)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, nh * m.v_head_dim))


@dataclass
class MLAArgs(ModelArgs):
    """ModelArgs of an MLA family. n_kv_heads = 1 and head_dim = r + dr describe the cached row (what
    the KV is sized by); the per-head widths are in `mla`."""

    mla: MLAShape | None = None
    attention_module: ClassVar[type] = MLAttention  # what common.Block builds instead of Attention


def deinterleave_rope_rows(weight: torch.Tensor, n_groups: int, group_width: int, rope_dim: int) -> torch.Tensor:
    """Rows (n_groups·group_width, …) whose last rope_dim rows of each group are RoPE'd as interleaved
    pairs → the same rows in rotate-half order (evens first, then odds). Works for weights and biases."""
    grouped = weight.reshape(n_groups, group_width, *weight.shape[1:])
    start = group_width - rope_dim
    order = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2))) + start
    out = grouped.clone()
    out[:, start:] = grouped[:, order]
    return out.reshape(weight.shape)
