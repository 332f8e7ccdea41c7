"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (transformers `glm4_moe`, llama.cpp `glm4moe`): config, names, routing.

The forward is `common.Decoder`; one block reads

    a = attn(norm(x))           q, k, v with biases (`attention_bias`), optional per-head q/k RMSNorm
                                (`use_qk_norm`), RoPE on the first hs·`partial_rotary_factor` dims only
    h = x + a
    y = routed(norm(h)) + shared(norm(h))   in layers ≥ `first_k_dense_replace`; before them a dense
                                SwiGLU of `intermediate_size`
    out = h + y

  - routed: `n_routed_experts` SwiGLU experts of `moe_intermediate_size`, top `num_experts_per_tok`,
    through the expert executor (so every expert policy applies);
  - shared: `n_shared_experts` experts fused into one SwiGLU of n_shared·moe_intermediate_size that
    every token runs: dense weights, always on the compute device;
  - routing (`route`): sigmoid scores in fp32; the experts are *chosen* on score + the learned
    `e_score_correction_bias` (within the best `topk_group` of `n_group` groups, a group scored by its
    best two), but *weighted* by the plain scores, renormalised iff `norm_topk_prob`, times
    `routed_scaling_factor`.
Checkpoints carry one multi-token-prediction layer past `num_hidden_layers` (GGUF counts it in
`block_count`, with `nextn_predict_layers`); plain decoding does not use it, so it is dropped. llama.cpp
stores q/k unpermuted (NEOX RoPE), names the second norm `post_attention_norm`, the shared expert
`ffn_*_shexp` and the correction bias `exp_probs_b.bias`.
"""

from __future__ import annotations

import re

import torch

from engine.errors import UnsupportedModelError
from engine.models.common import ModelArgs
from engine.models.expert_names import fuse_experts
from engine.models.gguf_names import moe_config_from_gguf, sanitize_moe_gguf
from engine.models.hf_config import decoder_args
from engine.models.qwen3_moe import check_activation

NAME = "glm4_moe"
GGUF_ARCHS = {"glm4moe"}
MODEL_TYPES = {"glm4_moe"}

SIGMOID_GATING = 2  # llama.cpp's expert_gating_func value for sigmoid scores


def _partial_rotary_factor(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 0.5)


def n_routed(config: dict) -> int:
    return int(config.get("n_routed_experts") or config.get("num_local_experts") or config.get("num_experts") or 0)


def args_from_config(config: dict) -> ModelArgs:
    check_activation(config)
    base = decoder_args(config, arch=NAME, default_theta=10000.0, default_max_position=131072)
    head_dim = config.get("head_dim") or base["dim"] // base["n_heads"]
    n_layers = base["n_layers"]
    first_dense = int(config.get("first_k_dense_replace", 1))
    expert_ffn = int(config.get("moe_intermediate_size") or 0)
    groups = int(config.get("n_group") or 1)
    return ModelArgs(
        **base,
        head_dim=head_dim,
        ffn_dim=int(config.get("intermediate_size") or 0),
        qk_norm=bool(config.get("use_qk_norm", False)),
        qk_norm_scope="head",
        qkv_bias=bool(config.get("attention_bias", False)),
        o_bias=False,  # o_proj has no bias, whatever attention_bias says
        rotary_dim=int(head_dim * _partial_rotary_factor(config)),
        n_experts=n_routed(config),
        top_k=int(config.get("num_experts_per_tok") or 0),
        expert_ffn_dim=expert_ffn,
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        moe_layers=list(range(min(first_dense, n_layers), n_layers)),
        shared_expert_ffn_dim=expert_ffn * int(config.get("n_shared_experts", 1) or 0),
        router_score_bias=True,
        router_groups=groups,
        router_groups_used=int(config.get("topk_group") or groups),
        routed_scaling=float(config.get("routed_scaling_factor", 1.0)),
    )


def route(logits: torch.Tensor, k: int, renormalise: bool = True, score_bias: torch.Tensor | None = None,
          groups: int = 1, groups_used: int = 1, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, E) → weights (N, k) fp32, ids (N, k). Without score_bias (the lookahead predictor)
    the choice is by the plain sigmoid scores."""
    scores = torch.sigmoid(logits.float())  # (N, E)
    choice = scores if score_bias is None else scores + score_bias.float()
    if groups > 1 and groups_used < groups:
        N, E = choice.shape
        per_group = choice.view(N, groups, E // groups)
        group_score = per_group.topk(2, dim=-1).values.sum(dim=-1)  # (N, G): each group's best two
        kept = group_score.topk(groups_used, dim=-1).indices  # (N, groups_used)
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)  # (N, G)
        choice = choice.masked_fill(~keep.repeat_interleave(E // groups, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices  # (N, k)
    weights = scores.gather(1, ids)  # weighted by the scores, not by the biased choice
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _main_layers_only(raw: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Drop the multi-token-prediction layer(s) stored past the decoder's last layer."""
    out = {}
    for name, t in raw.items():
        m = _LAYER.match(name)
        if m is None or int(m[1]) < n_layers:
            out[name] = t
    return out


def sanitize_hf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    raw = {k: v for k, v in raw.items() if "rotary_emb.inv_freq" not in k}
    return fuse_experts(_main_layers_only(raw, int(config["num_hidden_layers"])), n_routed(config))


def config_from_gguf(meta: dict) -> dict:
    a = meta["general.architecture"]

    def get(key, default=None):
        return meta.get(f"{a}.{key}", default)

    gating = int(get("expert_gating_func", SIGMOID_GATING))
    if gating != SIGMOID_GATING:
        raise UnsupportedModelError(f"this {a} GGUF routes with gating function {gating}, not sigmoid",
                                    "re-convert the model with a current llama.cpp")
    config = moe_config_from_gguf(meta, NAME)
    nextn = int(get("nextn_predict_layers", 0) or 0)
    config["num_hidden_layers"] -= nextn  # block_count includes the prediction layers
    config["num_nextn_predict_layers"] = nextn
    head_dim = config["head_dim"]
    rotary = int(get("rope.dimension_count", head_dim // 2))
    config["partial_rotary_factor"] = rotary / head_dim
    config["n_routed_experts"] = config.pop("num_experts")
    config["n_shared_experts"] = int(get("expert_shared_count", 1))
    config["first_k_dense_replace"] = int(get("leading_dense_block_count", 0))
    config["routed_scaling_factor"] = float(get("expert_weights_scale", 1.0))
    config["norm_topk_prob"] = bool(get("expert_weights_norm", True))
    config["n_group"] = int(get("expert_group_count", 1) or 1)
    config["topk_group"] = int(get("expert_group_used_count", 1) or config["n_group"])
    names = meta.get("tensors.names")  # a header-only read (models/shape.py): the tensors' names tell
    if names:
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in names
    return config


# llama.cpp names of the tensors only this family has → HF names (the shared map holds the rest)
_GGUF_EXTRA = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}


def sanitize_gguf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    n_layers = int(config["num_hidden_layers"])
    main, extra = {}, {}
    for name, t in raw.items():
        parts = name.split(".", 2)
        if parts[0] == "blk":
            layer = int(parts[1])
            if layer >= n_layers:
                continue  # the multi-token-prediction block
            if parts[2] in _GGUF_EXTRA:
                extra[f"model.layers.{layer}.{_GGUF_EXTRA[parts[2]]}"] = t
                continue
        main[name] = t
    out = sanitize_moe_gguf(main, config)
    out.update(extra)
    config.pop("mlp_only_layers", None)  # first_k_dense_replace says which layers are dense
    config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in out
    config["use_qk_norm"] = "model.layers.0.self_attn.q_norm.weight" in out
    config["n_routed_experts"] = config.pop("num_experts", None) or config["n_routed_experts"]
    return out
