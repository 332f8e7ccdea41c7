"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, …): config, name mapping, routing rule.

The forward is `common.Decoder`, with these family details:
  - attention: per-head RMSNorm on q and k (over hs, before RoPE), no biases unless
    `attention_bias`, plain RoPE (θ = 1e6 in the published models) or a static scaled variant;
    a sliding window only when `use_sliding_window` is set;
  - FFN: routed experts (`num_experts`, top `num_experts_per_tok`, `moe_intermediate_size`) in every
    layer except those in `mlp_only_layers` or off the `decoder_sparse_step` grid, which have a dense
    SwiGLU of `intermediate_size`; no shared expert;
  - routing: softmax over experts in fp32 → top-k → renormalise iff `norm_topk_prob`.
GGUF (llama.cpp `qwen3moe`) stores q/k unpermuted (NEOX RoPE) and always renormalises.
"""

from __future__ import annotations

import torch

from engine.errors import UnsupportedModelError
from engine.models.common import ModelArgs
from engine.models.moe_ffn import SoftmaxTopK
from engine.models.expert_names import sanitize_moe_hf
from engine.models.gguf_names import moe_config_from_gguf, sanitize_moe_gguf
from engine.models.hf_config import decoder_args, expert_count, sliding_window, sparse_layer_ids

NAME = "qwen3_moe"
GGUF_ARCHS = {"qwen3moe"}
MODEL_TYPES = {"qwen3_moe"}


def check_activation(config: dict) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"activation '{act}' of this {config.get('model_type')} model is not supported",
                                    "Tandem's expert kernels compute SwiGLU (silu) FFNs")


def args_from_config(config: dict) -> ModelArgs:
    check_activation(config)
    base = decoder_args(config, arch=NAME, default_theta=10000.0, default_eps=1e-6, default_max_position=32768)
    bias = bool(config.get("attention_bias", False))
    return ModelArgs(
        **base,
        head_dim=config.get("head_dim") or base["dim"] // base["n_heads"],
        ffn_dim=config.get("intermediate_size") or 0,
        qk_norm=True,
        qk_norm_scope="head",
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=sliding_window(config, enabled_key="use_sliding_window"),
        n_experts=expert_count(config),
        top_k=int(config.get("num_experts_per_tok") or 0),
        expert_ffn_dim=int(config.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        moe_layers=sparse_layer_ids(base["n_layers"], config.get("mlp_only_layers"), config.get("decoder_sparse_step")),
    )


route = SoftmaxTopK()  # renormalise the k weights iff norm_topk_prob


sanitize_hf = sanitize_moe_hf


def config_from_gguf(meta: dict) -> dict:
    config = moe_config_from_gguf(meta, NAME)
    # llama.cpp's qwen3moe graph always renormalises the top-k weights (as the published models do).
    config["norm_topk_prob"] = bool(meta.get(f"{meta['general.architecture']}.expert_weights_norm", True))
    return config


def sanitize_gguf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    return sanitize_moe_gguf(raw, config)
