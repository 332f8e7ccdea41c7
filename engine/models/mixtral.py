"""Mixtral (Mixtral-8x7B, Mixtral-8x22B): config, name mapping, routing rule.

The forward is `common.Decoder`, with these family details:
  - attention: llama-style GQA, no q/k norms, no biases, RoPE θ = 1e6; a sliding window when the
    config sets `sliding_window` (the published Mixtral configs set none);
  - FFN: every layer routes to `num_local_experts` SwiGLU experts of `intermediate_size`, top
    `num_experts_per_tok`; no shared expert;
  - routing: softmax over experts in fp32 → top-k → always renormalise (no config switch).
Checkpoints name the block `block_sparse_moe` with experts `w1/w3/w2` (gate/up/down); transformers
5.x names it `mlp` with fused experts. GGUF files carry Mixtral under llama.cpp's `llama`
architecture with an expert count, q/k rows permuted as for llama.
"""

from __future__ import annotations

import torch

from engine.models.common import ModelArgs
from engine.models.moe_ffn import SoftmaxTopK
from engine.models.expert_names import sanitize_moe_hf
from engine.models.gguf_names import moe_config_from_gguf, sanitize_moe_gguf
from engine.models.hf_config import decoder_args, expert_count, sliding_window
from engine.models.llama import _unpermute  # the inverse of llama.cpp's q/k permutation
from engine.models.qwen3_moe import check_activation

NAME = "mixtral"
GGUF_ARCHS: set[str] = set()  # llama.cpp writes Mixtral as "llama"; see claims_gguf
MODEL_TYPES = {"mixtral"}


def claims_gguf(meta: dict) -> bool:
    """A `llama` GGUF with routed experts is a Mixtral."""
    return meta.get("general.architecture") == "llama" and int(meta.get("llama.expert_count") or 0) > 0


def args_from_config(config: dict) -> ModelArgs:
    check_activation(config)
    base = decoder_args(config, arch=NAME, default_theta=1e6, default_max_position=32768)
    expert_ffn = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    return ModelArgs(
        **base,
        head_dim=config.get("head_dim") or base["dim"] // base["n_heads"],
        ffn_dim=expert_ffn,
        sliding_window=sliding_window(config),
        n_experts=expert_count(config),
        top_k=int(config["num_experts_per_tok"]),
        expert_ffn_dim=expert_ffn,
        norm_topk_prob=True,
    )


route = SoftmaxTopK(always=True)  # always renormalised, the config's flag ignored


sanitize_hf = sanitize_moe_hf


def config_from_gguf(meta: dict) -> dict:
    return moe_config_from_gguf(meta, NAME)


def sanitize_gguf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    return sanitize_moe_gguf(raw, config, unpermute_qk=_unpermute)
