"""OLMoE (OLMoE-1B-7B): config, name mapping, routing rule.

The forward is `common.Decoder`, with these family details:
  - attention: RMSNorm on q and k over the *whole* projection (q_norm over nh·hs, k_norm over
    n_kv·hs, before splitting into heads — unlike Qwen3's per-head norms), then an optional clamp of
    q, k, v to ±`clip_qkv`; biases only if `attention_bias`; plain RoPE (θ = 1e4); no window;
  - FFN: every layer routes to `num_experts` SwiGLU experts of `intermediate_size`, top
    `num_experts_per_tok`; no shared expert;
  - routing: softmax over experts in fp32 → top-k → renormalise iff `norm_topk_prob` (false in the
    published model).
GGUF (llama.cpp `olmoe`) stores q/k unpermuted (NEOX RoPE).
"""

from __future__ import annotations

import torch

from engine.models.common import ModelArgs
from engine.models.moe_ffn import SoftmaxTopK
from engine.models.expert_names import sanitize_moe_hf
from engine.models.gguf_names import moe_config_from_gguf, sanitize_moe_gguf
from engine.models.hf_config import decoder_args, expert_count
from engine.models.qwen3_moe import check_activation

NAME = "olmoe"
GGUF_ARCHS = {"olmoe"}
MODEL_TYPES = {"olmoe"}


def args_from_config(config: dict) -> ModelArgs:
    check_activation(config)
    base = decoder_args(config, arch=NAME, default_theta=10000.0)
    bias = bool(config.get("attention_bias", False))
    expert_ffn = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    clip = config.get("clip_qkv")
    return ModelArgs(
        **base,
        head_dim=base["dim"] // base["n_heads"],  # OLMoE's norms assume it: q_norm spans hidden_size
        ffn_dim=expert_ffn,
        qk_norm=True,
        qk_norm_scope="all",
        qkv_bias=bias,
        o_bias=bias,
        clip_qkv=float(clip) if clip else None,
        n_experts=expert_count(config),
        top_k=int(config["num_experts_per_tok"]),
        expert_ffn_dim=expert_ffn,
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
    )


route = SoftmaxTopK()  # renormalise the k weights iff norm_topk_prob


sanitize_hf = sanitize_moe_hf


def config_from_gguf(meta: dict) -> dict:
    a = meta["general.architecture"]
    config = moe_config_from_gguf(meta, NAME)
    config["norm_topk_prob"] = bool(meta.get(f"{a}.expert_weights_norm", False))
    clamp = meta.get(f"{a}.attention.clamp_kqv")
    if clamp:
        config["clip_qkv"] = float(clamp)
    return config


def sanitize_gguf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    return sanitize_moe_gguf(raw, config)
