"""Qwen3.5-MoE / Qwen3.6-MoE (transformers `qwen3_5_moe`, llama.cpp `qwen35moe`): a hybrid decoder.

Three layers in four (`layer_types` "linear_attention", or every `full_attention_interval`-th layer
full) mix tokens with Gated DeltaNet (models/gated_deltanet.py: a recurrent state per sequence, no
KV); the fourth with full attention. Every layer's FFN is routed. One block reads

    a = mixer(norm(x))      linear: Gated DeltaNet
                            full:   q_proj yields per head [q | gate]; per-head RMSNorm on q and k; RoPE
                                    on the first hs·`partial_rotary_factor` dims (64 of 256); attention
                                    through the KV backend; o_proj(attn · σ(gate))
    h = x + a
    y = Σ_k w_k · expert_k(norm(h)) + σ(shared_expert_gate · norm(h)) · shared(norm(h))
    out = h + y

  - routing (`route`): softmax over experts in fp32 → top-k → always renormalised;
  - the shared expert is one dense SwiGLU of `shared_expert_intermediate_size` that every token runs,
    scaled by a sigmoid of a learned projection (one scalar per token).
  - norms: the checkpoints' RMSNorms (all but the DeltaNet's gated one) scale by (1 + w); `sanitize`
    adds the 1 so the common RMSNorm (w · x̂) computes them. llama.cpp's converter does the same.
  - RoPE: the release computes multimodal RoPE (`mrope_section`); for text all three position ids are
    the token's position, and the sections then reduce to plain RoPE over the rotary dims.

Only the full-attention layers store KV (ModelArgs.attention_layers): the KV backend is built for
those, a quarter of the layers, and the recurrent state travels beside it (engine/kv/recurrent.py).
Checkpoints are the vision-language release (`Qwen3_5MoeForConditionalGeneration`: the text model
under `model.language_model.`, `text_config` nested in config.json, a vision tower that Tandem does
not run and drops) or text-only; both may carry a multi-token-prediction head (`mtp.*`), dropped.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.common import (
    Attention,
    Decoder,
    ModelArgs,
    RMSNorm,
    apply_partial_rope,
    token_embedding,
)
from engine.models.moe_ffn import MoEFeedForward, SoftmaxTopK
from engine.models.expert_names import fuse_experts
from engine.models.gated_deltanet import DeltaNetShape, GatedDeltaNet
from engine.models.hf_config import decoder_args, expert_count
from engine.models.qwen3_5_moe_gguf import config_from_gguf, sanitize_gguf  # noqa: F401 (the family's GGUF side)
from engine.models.qwen3_moe import check_activation

NAME = "qwen3_5_moe"
GGUF_ARCHS = {"qwen35moe"}
MODEL_TYPES = {"qwen3_5_moe", "qwen3_5_moe_text"}

FULL_ATTENTION_INTERVAL = 4  # the configs' default: layers 3, 7, 11, … attend over all of the past


def text_config(config: dict) -> dict:
    """The language model's config: the release nests it in `text_config` (the outer keys describe
    the vision tower and its special tokens); a text-only config is returned as it is."""
    inner = config.get("text_config")
    if not inner:
        return config
    out = dict(inner)
    out["model_type"] = NAME
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key not in out and key in config:
            out[key] = config[key]
    return out


def layer_types(config: dict) -> list[str]:
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types:
        return list(types[:n])
    interval = int(config.get("full_attention_interval") or FULL_ATTENTION_INTERVAL)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def _partial_rotary_factor(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 0.25)


def args_from_config(config: dict) -> ModelArgs:
    config = text_config(config)
    check_activation(config)
    base = decoder_args(config, arch=NAME, default_theta=10000.0, default_eps=1e-6, default_max_position=262144)
    head_dim = int(config.get("head_dim") or 256)
    types = layer_types(config)
    return ModelArgs(
        **base,
        head_dim=head_dim,
        ffn_dim=0,  # no dense FFN: every layer routes
        qk_norm=True,
        qk_norm_scope="head",
        qkv_bias=bool(config.get("attention_bias", False)),
        o_bias=bool(config.get("attention_bias", False)),
        rotary_dim=int(head_dim * _partial_rotary_factor(config)),
        n_experts=expert_count(config),
        top_k=int(config.get("num_experts_per_tok") or 0),
        expert_ffn_dim=int(config.get("moe_intermediate_size") or 0),
        norm_topk_prob=True,  # the router always renormalises the top-k weights
        shared_expert_ffn_dim=int(config.get("shared_expert_intermediate_size") or 0),
        shared_expert_gate=True,
        attn_output_gate=True,
        attention_layers=[i for i, t in enumerate(types) if t == "full_attention"],
        linear_attn=DeltaNetShape(
            n_k_heads=int(config.get("linear_num_key_heads", 16)),
            n_v_heads=int(config.get("linear_num_value_heads", 32)),
            k_head_dim=int(config.get("linear_key_head_dim", 128)),
            v_head_dim=int(config.get("linear_value_head_dim", 128)),
            conv_kernel=int(config.get("linear_conv_kernel_dim", 4))),
    )


route = SoftmaxTopK(always=True)  # renormalised whatever the config says


class GatedAttention(Attention):
    """Full attention with a sigmoid gate on its output, per head and channel. `kv_index` is the
    layer's place among the full-attention layers: the KV backend holds those only."""

    def __init__(self, args: ModelArgs, layer_idx: int, kv_index: int):
        super().__init__(args, kv_index)
        self.decoder_layer = layer_idx
        self.q_proj = nn.Linear(args.dim, 2 * args.n_heads * args.head_dim, bias=args.qkv_bias)  # per head [q | gate]

    def fuse_qkv(self) -> None:
        """Kept apart: the fused projection and RoPE kernels know neither the gate nor partial RoPE."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv) -> torch.Tensor:
        B, T, _ = x.shape
        hs = self.head_dim
        q, gate = self.q_proj(x).view(B, T, self.n_heads, 2 * hs).split(hs, dim=-1)  # (B, T, nh, hs) each
        k = self.k_proj(x).view(B, T, self.n_kv_heads, hs)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, hs)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs), (B, n_kv, T, hs) ×2
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        y = kv.attend(self.layer_idx, q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(y)


class GatedSharedMoE(MoEFeedForward):
    """Routed experts (through the executor) plus a shared expert scaled by σ(shared_expert_gate · x)."""

    def __init__(self, args: ModelArgs, layer_idx: int, expert_layer: int):
        super().__init__(args, layer_idx, route, expert_layer)
        self.shared_expert_gate = nn.Linear(args.dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        flat = x.reshape(B * T, H)
        weights, ids = self.route(self.gate(flat), self.top_k)  # (B·T, k) each
        y = self.experts.run(self.expert_layer, flat, ids, weights.to(x.dtype))  # (B·T, H)
        y = y + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_experts(flat)
        return y.view(B, T, H)


class HybridBlock(nn.Module):
    """A block whose mixer is Gated DeltaNet (`linear_attn`) or gated full attention (`self_attn`)."""

    def __init__(self, args: ModelArgs, mixer: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.is_linear = isinstance(mixer, GatedDeltaNet)
        if self.is_linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv) -> torch.Tensor:
        h_in = self.input_layernorm(x)
        a = self.linear_attn(h_in, kv) if self.is_linear else self.self_attn(h_in, cos, sin, kv)
        h, h_normed = self.post_attention_layernorm.add_forward(x, a)  # h = x + a, and its norm
        return h + self.mlp(h_normed)


class Model(Decoder):
    """`common.Decoder` with the hybrid blocks; its forward (embedding → blocks → norm → head) is the
    common one. `make_mlp` is not used: every layer is a GatedSharedMoE."""

    def __init__(self, args: ModelArgs, make_mlp=None):
        nn.Module.__init__(self)
        self.args = args
        kv_index = {layer: j for j, layer in enumerate(args.kv_layer_ids())}
        moe_index = {layer: j for j, layer in enumerate(args.moe_layer_ids())}
        blocks, n_linear = [], 0
        for i in range(args.n_layers):
            if i in kv_index:
                mixer = GatedAttention(args, i, kv_index[i])
            else:
                mixer = GatedDeltaNet(args.dim, args.linear_attn, args.norm_eps, state_index=n_linear)
                n_linear += 1
            blocks.append(HybridBlock(args, mixer, GatedSharedMoE(args, i, moe_index[i])))
        self.model = nn.Module()
        self.model.embed_tokens = token_embedding(args.vocab_size, args.dim)
        self.model.layers = nn.ModuleList(blocks)
        self.model.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rope_cos = self.rope_sin = None
        self.n_linear_layers = n_linear


# -- checkpoint names ------------------------------------------------------------------------------

_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight")


def _centred(name: str) -> bool:
    return name == "model.norm.weight" or name.endswith(_ZERO_CENTRED)


def sanitize_hf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The text model's tensors under the engine's names: the vision tower, the prediction head and
    cached RoPE buffers dropped; (1 + w) norms as w; the shared expert under the common name."""
    out = {}
    for name, t in raw.items():
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        if name.startswith(("model.visual.", "mtp.", "model.mtp.")) or "rotary_emb.inv_freq" in name:
            continue
        if _centred(name):
            t = t + 1.0
        out[name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")] = t
    return fuse_experts(out, expert_count(text_config(config)))
