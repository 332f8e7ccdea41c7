"""Pieces every architecture family shares: config, norms, RoPE, attention, the dense FFN, the block
(the routed FFN and its routing rule: engine/models/moe_ffn.py).

Parameter names follow the Hugging Face checkpoints (`model.layers.{i}.self_attn.q_proj.weight` …)
so a folder's state dict loads as it is and a GGUF file only needs its names mapped (`sanitize`).
Attention goes through a KV/attention backend (engine/kv) and routed experts through an expert
executor (engine/experts): the model composes, it does not place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ConfigError
from engine.kernels import layer_ops_cpu, qkv_rope_gpu, rmsnorm_gpu, rope_gpu
from engine.kernels.experts_torch import swiglu
from engine.quant.blocks import QuantRows, QuantTensor
from engine.quant.matmul import quant_linear
from engine.quant.modules import QuantLinear


@dataclass
class ModelArgs:
    """Shape of a decoder-only transformer, read from a config.json or GGUF metadata."""

    arch: str  # family name: "llama", "qwen3_moe", …
    vocab_size: int
    dim: int  # hidden size H
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int  # dense FFN intermediate size I
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_position: int = 8192
    tie_embeddings: bool = False
    qk_norm: bool = False  # RMSNorm on q and k before RoPE (Qwen3, OLMoE)
    qk_norm_scope: str = "head"  # "head": over each head's hs (Qwen3); "all": over all heads' projection (OLMoE)
    qkv_bias: bool = False  # biases on q/k/v_proj
    o_bias: bool = False  # bias on o_proj
    clip_qkv: float | None = None  # clamp q, k, v to ±clip (OLMoE option: after its whole-projection norms)
    sliding_window: int | None = None  # a query sees itself and the window−1 keys before it; None: all
    rope_inv_freq: torch.Tensor | None = None  # (hs/2,) fp32 for scaled RoPE variants; None: θ^(−2i/hs)
    rope_attention_factor: float = 1.0  # cos/sin multiplier of the scaled variants (YaRN)
    # MoE (0 experts = dense FFN everywhere)
    n_experts: int = 0
    top_k: int = 0
    expert_ffn_dim: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[int] | None = None  # layers whose FFN is routed; None: every layer (when n_experts > 0)
    rotary_dim: int | None = None  # RoPE turns the first rotary_dim of each head (GLM: hs/2); None: all hs
    shared_expert_ffn_dim: int = 0  # a SwiGLU every token runs beside its routed experts (GLM); 0: none
    router_score_bias: bool = False  # a per-expert bias on the scores that choose, not on the weights (GLM)
    router_groups: int = 1  # group-limited top-k: experts in groups, only the best groups_used compete
    router_groups_used: int = 1
    routed_scaling: float = 1.0  # the routed experts' weights times this (GLM's routed_scaling_factor)
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    expert_bias: bool = False  # biases on every expert's gate_up and down projections (gpt-oss)
    expert_act: str = "silu"  # "silu": SwiGLU; "clamped": gpt-oss's clamped SwiGLU (expert_alpha, expert_limit)
    expert_alpha: float = 1.702
    expert_limit: float = 7.0
    attn_sinks: bool = False  # a learned per-head logit in each softmax's denominator (gpt-oss)
    layer_windows: list[int | None] | None = None  # per layer: its sliding window or None (full); None: sliding_window
    # hybrid linear/full attention (Qwen3.5): layers whose attention keeps KV (the rest carry a recurrent
    # state instead, shaped by linear_attn: a gated_deltanet.DeltaNetShape); None: every layer
    attention_layers: list[int] | None = None
    linear_attn: object | None = None
    attn_output_gate: bool = False  # q_proj also yields a per-head gate: o_proj(attn · σ(gate)) (Qwen3.5)
    shared_expert_gate: bool = False  # the shared expert's output times σ(a learned scalar of x) (Qwen3.5)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def kv_layer_ids(self) -> list[int]:
        """Decoder layers whose attention stores KV, ascending (the KV backend's layers, in order)."""
        return list(range(self.n_layers)) if self.attention_layers is None else sorted(self.attention_layers)

    def moe_layer_ids(self) -> list[int]:
        """Decoder layers with routed experts, ascending; the rest have a dense FFN of ffn_dim."""
        if not self.is_moe:
            return []
        return list(range(self.n_layers)) if self.moe_layers is None else sorted(self.moe_layers)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rmsnorm_gpu.available(x, self.weight):  # one kernel instead of eight, same rounding
            return rmsnorm_gpu.rms_norm(x, self.weight, self.eps)
        if layer_ops_cpu.available(x, self.weight):  # one call instead of six torch ops
            return layer_ops_cpu.rms_norm(x, self.weight, self.eps)
        # Normalise in fp32 whatever the weights' dtype, as the reference implementations do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, this norm of it): one kernel on the GPU."""
        if rmsnorm_gpu.available(x, self.weight) and r.is_contiguous() and r.dtype == x.dtype:
            return rmsnorm_gpu.add_rms_norm(x, r, self.weight, self.eps)
        if layer_ops_cpu.available(x, r, self.weight) and x.shape == r.shape:
            return layer_ops_cpu.add_rms_norm(x, r, self.weight, self.eps)
        h = x + r
        return h, self(h)


def rope_tables(head_dim: int, theta: float, n_pos: int, device, dtype, inv_freq: torch.Tensor | None = None,
                attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (n_pos, head_dim) in the rotate-half layout of the HF checkpoints.

    `inv_freq` (hs/2,) and `attention_factor` come from a scaled RoPE variant (linear, YaRN, llama3);
    without them the plain frequencies θ^(−2i/hs) are used.
    """
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # (hs/2,)
    t = torch.arange(n_pos, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float().cpu())  # (n_pos, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (n_pos, hs)
    cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, nh, T, hs); cos, sin: (B, 1, T, hs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of each head, the rest unchanged (GLM-4.5's partial RoPE).
    x: (B, nh, T, hs); cos, sin: (B, 1, T, rd) with rd < hs."""
    rd = cos.shape[-1]
    return torch.cat((apply_rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        self.norm_all_heads = args.qk_norm_scope == "all"
        self.clip_qkv = args.clip_qkv
        self.rotary_dim = args.rotary_dim or args.head_dim  # < hs: the rest of each head passes unrotated
        if args.qk_norm:
            q_dim = args.n_heads * args.head_dim if self.norm_all_heads else args.head_dim
            k_dim = args.n_kv_heads * args.head_dim if self.norm_all_heads else args.head_dim
            self.q_norm = RMSNorm(q_dim, args.norm_eps)
            self.k_norm = RMSNorm(k_dim, args.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.zeros(args.n_heads)) if args.attn_sinks else None  # (nh,)
        # what the KV backend is told beyond q, k, v: the sinks, and this layer's window where they differ
        self.attend_options = {} if args.layer_windows is None else {"window": args.layer_windows[layer_idx]}
        # set by fuse_qkv; buffers, so that a later .to() moves them too (outside the state dict)
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.qkv_blocks: QuantRows | QuantTensor | None = None  # set by fuse_qkv where q, k and v are blocks

    def fuse_qkv(self) -> None:
        """Project q, k and v with one product. Weights in blocks on the CPU become one QuantRows (the
        three matrices, no copy: one native call; their types may differ, as in Q4_K_M files). Float
        weights are laid out as one tensor, the three parameters becoming views of it: no memory added,
        and a GPU decode step projects with one GEMM; there OLMoE's whole-projection norms and clipping
        keep the three projections, and partial RoPE (GLM) the unfused path: the fused kernel rotates
        whole heads. Blocks of one type on a GPU are stacked as one QuantTensor, the same way (one GEMV
        launch, then the fused norms and RoPE); of several types, or some in blocks and some not, they
        stay apart."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        whole_heads = not (self.norm_all_heads or self.clip_qkv is not None or self.rotary_dim != self.head_dim)
        if any(isinstance(p, QuantLinear) for p in projections):
            if not all(isinstance(p, QuantLinear) for p in projections):
                return
            if all(p.qweight.blocks.device.type == "cpu" for p in projections):
                self.qkv_blocks = QuantRows([p.qweight for p in projections], "qkv")
            elif whole_heads and len({(p.qweight.qtype.code, p.qweight.blocks.device) for p in projections}) == 1:
                self.qkv_blocks = QuantTensor.stacked([p.qweight for p in projections], "qkv")
                for p, rows in zip(projections, self.qkv_blocks.parts_of([p.out_features for p in projections])):
                    p.qweight, p.blocks = rows, nn.Parameter(rows.blocks, requires_grad=False)  # views of it
            else:
                return
            if self.q_proj.bias is not None:
                self.qkv_bias = torch.cat([p.bias.detach() for p in projections])
            return
        if not whole_heads:
            return
        sizes = [p.out_features for p in projections]
        weight = torch.cat([p.weight.detach() for p in projections])  # ((nh + 2·n_kv)·hs, dim)
        bias = torch.cat([p.bias.detach() for p in projections]) if self.q_proj.bias is not None else None
        bias_parts = bias.split(sizes) if bias is not None else (None,) * 3
        for p, w_part, b_part in zip(projections, weight.split(sizes), bias_parts):
            p.weight = nn.Parameter(w_part, requires_grad=False)
            if b_part is not None:
                p.bias = nn.Parameter(b_part, requires_grad=False)
        self.qkv_weight, self.qkv_bias = weight, bias

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv) -> torch.Tensor:
        B, T, _ = x.shape
        if (self.qkv_weight is not None or self.qkv_blocks is not None) and qkv_rope_gpu.available(x, cos):
            q, k, v = self._qkv_fused(x, cos, sin, kv.decode_store(self.layer_idx))  # k, v None: stored
        else:
            q, k, v = self._qkv(x, cos, sin)
        if self.sinks is None and not self.attend_options:
            y = kv.attend(self.layer_idx, q, k, v)  # (B, nh, T, hs): stores k, v, attends over the past
        else:
            if not getattr(kv, "supports_sinks", False):
                raise ConfigError(f"kv_policy '{kv.policy}' cannot honour this model's attention sinks and "
                                  "per-layer windows", "use kv_policy resident or writescope")
            sinks = {"sinks": self.sinks} if self.sinks is not None else {}
            y = kv.attend(self.layer_idx, q, k, v, **sinks, **self.attend_options)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def _qkv_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, store=None):
        """Two kernels: one GEMM (or GEMV over blocks), then norms and RoPE (engine/kernels/qkv_rope_gpu.py),
        which with `store` (the KV backend's decode_store) also writes k and v into their cache rows."""
        if self.qkv_weight is not None:
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # (B, T, (nh + 2·n_kv)·hs)
        else:
            qkv = quant_linear(x, self.qkv_blocks, self.qkv_bias)
        if self.q_norm is not None:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        else:
            norms = (None, None, 0.0)
        q, k, v = qkv_rope_gpu.qk_norm_rope(qkv, self.n_heads, self.n_kv_heads, cos, sin, *norms, store=store)
        return (None if t is None else t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs), (B, n_kv, T, hs) ×2

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, dim) → q (B, T, nh·hs), k, v (B, T, n_kv·hs): one product where fuse_qkv made one."""
        if self.qkv_blocks is not None:
            qkv = quant_linear(x, self.qkv_blocks, self.qkv_bias)  # (B, T, (nh + 2·n_kv)·hs)
        elif self.qkv_weight is not None:
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        else:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv_width = self.n_kv_heads * self.head_dim
        return qkv.split_with_sizes((self.n_heads * self.head_dim, kv_width, kv_width), dim=-1)  # views

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        B, T, _ = x.shape
        q, k, v = self._project(x)  # (B, T, nh·hs), (B, T, n_kv·hs) ×2
        if self.q_norm is not None and self.norm_all_heads:  # OLMoE: one norm over every head at once
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.norm_all_heads:  # Qwen3: each head on its own
            q, k = self.q_norm(q), self.k_norm(k)
        partial = self.rotary_dim != self.head_dim
        if not partial and rope_gpu.available(q, cos) and k.is_contiguous():  # one kernel each, the same rounding
            q, k = rope_gpu.rope(q, cos, sin), rope_gpu.rope(k, cos, sin)
            return (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if layer_ops_cpu.available(q, k, cos, sin) and layer_ops_cpu.rope_fits(q, cos) and layer_ops_cpu.rope_fits(k, cos):
            # in place: q and k are this step's own tensors (projections, or the norms' outputs)
            q, k = layer_ops_cpu.rope_(q, cos, sin), layer_ops_cpu.rope_(k, cos, sin)
            return (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if partial:  # cos, sin: (B, 1, T, rotary_dim)
            return apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin), v
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class FeedForward(nn.Module):
    """Dense SwiGLU FFN."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.gate_up_blocks: QuantRows | None = None  # set by fuse_gate_up

    def fuse_gate_up(self) -> None:
        """Gate and up in blocks on the CPU: one product over both (a QuantRows, no copy)."""
        if all(isinstance(p, QuantLinear) and p.qweight.blocks.device.type == "cpu" for p in (self.gate_proj, self.up_proj)):
            self.gate_up_blocks = QuantRows([self.gate_proj.qweight, self.up_proj.qweight], "gate_up")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_blocks is not None:
            return self.down_proj(swiglu(quant_linear(x, self.gate_up_blocks)))  # (…, 2I) → (…, I) → (…, H)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        # a family whose attention is not the q/k/v form (MLA: engine/models/mla.py) names its module on its args
        self.self_attn = getattr(args, "attention_module", Attention)(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), cos, sin, kv)
        h, h_normed = self.post_attention_layernorm.add_forward(x, a)  # h = x + a, and its norm
        return h + self.mlp(h_normed)


def token_embedding(vocab: int, dim: int) -> nn.Embedding:
    """An embedding without its random initialisation (the checkpoint's weights replace it): built on
    the meta device, nn.Embedding's own init imports torch._dynamo, 1.6 s of every load."""
    return nn.Embedding(vocab, dim, _weight=torch.empty(vocab, dim))


class Decoder(nn.Module):
    """Embedding → blocks → norm → LM head. Positions come from the KV backend's current step."""

    def __init__(self, args: ModelArgs, make_mlp):
        super().__init__()
        self.args = args
        self.model = nn.Module()
        self.model.embed_tokens = token_embedding(args.vocab_size, args.dim)
        self.model.layers = nn.ModuleList(Block(args, i, make_mlp(i)) for i in range(args.n_layers))
        self.model.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rope_cos = self.rope_sin = None  # (max_position, rotary_dim or hs), set by init_rope

    def init_rope(self, n_pos: int, device, dtype) -> None:
        a = self.args
        self.rope_cos, self.rope_sin = rope_tables(a.rotary_dim or a.head_dim, a.rope_theta, n_pos, device, dtype,
                                                   a.rope_inv_freq, a.rope_attention_factor)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, kv, last_only: bool = True) -> torch.Tensor:
        """tokens, positions: (B, T) → logits (B, vocab) of the last position, or (B, T, vocab)."""
        x = self.model.embed_tokens(tokens)  # (B, T, H)
        cos = self.rope_cos[positions].unsqueeze(1)  # (B, 1, T, hs)
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer in self.model.layers:
            x = layer(x, cos, sin, kv)
        if last_only:
            x = x[:, -1]
        return self.lm_head(self.model.norm(x)).float()
