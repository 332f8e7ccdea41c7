"""DeepSeek-V2 / DeepSeek-V2-Lite (transformers `deepseek_v2`, llama.cpp `deepseek2`): config, names, routing.

The forward is `common.Decoder`; one block reads

    a = mla(norm(x))            multi-head latent attention (engine/models/mla.py): the cache keeps one
                                [latent, RoPE key] row per token, decode attends in the absorbed form
    h = x + a
    y = routed(norm(h)) + shared(norm(h))   in layers ≥ `first_k_dense_replace`; before them a dense
                                SwiGLU of `intermediate_size`
    out = h + y

  - routed: `n_routed_experts` SwiGLU experts of `moe_intermediate_size`, top `num_experts_per_tok`,
    through the expert executor (so every expert policy applies);
  - shared: `n_shared_experts` experts fused into one SwiGLU every token runs (dense weights);
  - routing (`route`): softmax over all experts in fp32; top-k greedily (`topk_method` "greedy", V2-Lite)
    or within the `topk_group` groups of `n_group` whose best expert scores highest
    ("group_limited_greedy", V2); weights *not* renormalised (transformers ignores `norm_topk_prob`
    for this family, and the published configs say false), times `routed_scaling_factor`;
  - RoPE on the dr = `qk_rope_head_dim` dims only, YaRN-scaled in the published models; YaRN's mscale
    (`mscale_all_dim`) also enters the softmax scale, squared.

llama.cpp's converter writes kv_b_proj either whole (`attn_kv_b`) or, for its absorbed MLA, split into
`attn_k_b` (nh, r, dn: the K half transposed) and `attn_v_b` (nh, dv, r); both load. It records
MLA's per-head widths in `key_length_mla` / `value_length_mla` (`key_length` then is r + dr) and
YaRN's mscale_all_dim as 0.1·mscale_all_dim in `rope.scaling.yarn_log_multiplier`.
"""

from __future__ import annotations

import re

import torch

from engine.errors import UnsupportedModelError
from engine.models.expert_names import fuse_experts
from engine.models.gguf_names import moe_config_from_gguf, sanitize_moe_gguf
from engine.models.hf_config import decoder_args
from engine.models.mla import MLAArgs, MLAShape, deinterleave_rope_rows, yarn_mscale
from engine.models.qwen3_moe import check_activation

NAME = "deepseek_v2"
GGUF_ARCHS = {"deepseek2"}
MODEL_TYPES = {"deepseek_v2"}

SOFTMAX_GATING = 1  # llama.cpp's expert_gating_func value for softmax scores
TOPK_METHODS = ("greedy", "group_limited_greedy")


def _rope_params(config: dict) -> dict:
    return dict(config.get("rope_parameters") or config.get("rope_scaling") or {})


def softmax_scale(config: dict) -> float:
    """(dn + dr)^−½, times mscale² of YaRN (`mscale_all_dim`) when RoPE is scaled, as the reference."""
    scale = (int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"])) ** -0.5
    params = _rope_params(config)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2
    return scale


def args_from_config(config: dict) -> MLAArgs:
    check_activation(config)
    if config.get("mlp_bias"):
        raise UnsupportedModelError("this deepseek_v2 model has biases on its FFNs", "Tandem's FFNs have none")
    method = config.get("topk_method") or "greedy"
    if method not in TOPK_METHODS:
        raise UnsupportedModelError(f"expert selection '{method}' of this deepseek_v2 model is not supported",
                                    f"Tandem routes DeepSeek-V2 with {' or '.join(TOPK_METHODS)}")
    # RoPE covers the dr dims only: the reference's config sets head_dim to qk_rope_head_dim for it
    base = decoder_args({**config, "head_dim": config["qk_rope_head_dim"]}, arch=NAME, default_theta=10000.0,
                        default_eps=1e-6, default_max_position=163840)
    n_layers = base["n_layers"]
    mla = MLAShape(kv_lora_rank=int(config["kv_lora_rank"]), qk_nope_head_dim=int(config["qk_nope_head_dim"]),
                   qk_rope_head_dim=int(config["qk_rope_head_dim"]), v_head_dim=int(config["v_head_dim"]),
                   q_lora_rank=int(config["q_lora_rank"]) if config.get("q_lora_rank") else None,
                   softmax_scale=softmax_scale(config))
    expert_ffn = int(config.get("moe_intermediate_size") or 0)
    groups = int(config.get("n_group") or 1) if method == "group_limited_greedy" else 1
    first_dense = int(config.get("first_k_dense_replace") or 0)
    base["n_kv_heads"] = 1  # the cached row is one "KV head" every query head reads
    return MLAArgs(
        **base,
        head_dim=mla.row_width,  # the cached row's width: what the KV is sized by
        ffn_dim=int(config.get("intermediate_size") or 0),
        qkv_bias=bool(config.get("attention_bias", False)),  # on q_a_proj and kv_a_proj_with_mqa
        o_bias=bool(config.get("attention_bias", False)),
        rotary_dim=mla.qk_rope_head_dim,
        n_experts=int(config.get("n_routed_experts") or 0),
        top_k=int(config.get("num_experts_per_tok") or 0),
        expert_ffn_dim=expert_ffn,
        norm_topk_prob=False,
        moe_layers=list(range(min(first_dense, n_layers), n_layers)),
        shared_expert_ffn_dim=expert_ffn * int(config.get("n_shared_experts") or 0),
        router_groups=groups,
        router_groups_used=int(config.get("topk_group") or groups) if groups > 1 else 1,
        routed_scaling=float(config.get("routed_scaling_factor") or 1.0),
        mla=mla,
    )


def route(logits: torch.Tensor, k: int, renormalise: bool = False, score_bias: torch.Tensor | None = None,
          groups: int = 1, groups_used: int = 1, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, E) → weights (N, k) fp32, ids (N, k). score_bias is unused (no DeepSeek-V2 router has one)."""
    scores = torch.softmax(logits.float(), dim=-1)  # (N, E)
    choice = scores
    if groups > 1 and groups_used < groups:
        N, E = scores.shape
        group_best = scores.view(N, groups, E // groups).amax(dim=-1)  # (N, G): a group scores by its best
        kept = group_best.topk(groups_used, dim=-1).indices  # (N, groups_used)
        keep = torch.zeros_like(group_best, dtype=torch.bool).scatter_(1, kept, True)  # (N, G)
        choice = scores.masked_fill(~keep.repeat_interleave(E // groups, dim=1), 0.0)  # softmax > 0 elsewhere
    weights, ids = choice.topk(k, dim=-1)  # (N, k)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


# -- names -----------------------------------------------------------------------------------------

def _plain(t):
    """A matrix whose rows are re-laid here or that MLA absorbs (kv_b): dequantised where a quantised
    GGUF's loader kept it in blocks (engine/quant); the other projections may stay in blocks."""
    return t.dequantize() if hasattr(t, "dequantize") else t


def _to_rotate_half(out: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The checkpoints' interleaved RoPE rows → rotate-half order (engine/models/mla.py says why)."""
    nh, dn, dr, r = (int(config[k]) for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                              "kv_lora_rank"))
    for name in list(out):
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            out[name] = deinterleave_rope_rows(_plain(out[name]), nh, dn + dr, dr)
        elif ".self_attn.kv_a_proj_with_mqa." in name:  # weight (r + dr, H) or bias (r + dr,)
            out[name] = deinterleave_rope_rows(_plain(out[name]), 1, r + dr, dr)
        elif name.endswith("self_attn.kv_b_proj.weight"):
            out[name] = _plain(out[name])
    return out


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def sanitize_hf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    n_layers = int(config["num_hidden_layers"])
    kept = {}
    for name, t in raw.items():
        m = _LAYER.match(name)
        if "rotary_emb.inv_freq" in name or (m is not None and int(m[1]) >= n_layers):
            continue  # recomputed; or a multi-token-prediction layer past the decoder (V3-style files)
        kept[name] = t
    return _to_rotate_half(fuse_experts(kept, int(config.get("n_routed_experts") or 0)), config)


def config_from_gguf(meta: dict) -> dict:
    a = meta["general.architecture"]

    def get(key, default=None):
        return meta.get(f"{a}.{key}", default)

    gating = int(get("expert_gating_func", SOFTMAX_GATING) or SOFTMAX_GATING)
    if gating != SOFTMAX_GATING:
        raise UnsupportedModelError(f"this {a} GGUF routes with gating function {gating}, not softmax "
                                    "(a DeepSeek-V3-style model)", "Tandem runs DeepSeek-V2 and V2-Lite")
    config = moe_config_from_gguf(meta, NAME)
    n_heads = config["num_attention_heads"]
    config["num_key_value_heads"] = n_heads  # the file says 1 (MQA over latent rows); the config form is MHA
    rope = int(get("rope.dimension_count"))
    kv_rank = int(get("attention.kv_lora_rank"))
    if get("attention.key_length_mla"):  # newer converts: key_length is then r + dr
        key, value = int(get("attention.key_length_mla")), int(get("attention.value_length_mla"))
    else:
        key, value = int(get("attention.key_length")), int(get("attention.value_length"))
    config.update(qk_rope_head_dim=rope, qk_nope_head_dim=key - rope, v_head_dim=value, kv_lora_rank=kv_rank,
                  q_lora_rank=int(get("attention.q_lora_rank", 0) or 0) or None, head_dim=rope)
    config["n_routed_experts"] = config.pop("num_experts")
    config["n_shared_experts"] = int(get("expert_shared_count", 0))
    config["first_k_dense_replace"] = int(get("leading_dense_block_count", 0))
    config["routed_scaling_factor"] = float(get("expert_weights_scale", 1.0) or 1.0)
    groups = int(get("expert_group_count", 1) or 1)
    if groups > 1:  # older converts of V2 do not record its groups; llama.cpp then routes greedily too
        config.update(topk_method="group_limited_greedy", n_group=groups,
                      topk_group=int(get("expert_group_used_count", groups) or groups))
    else:
        config["topk_method"] = "greedy"
    scaling = config.pop("rope_scaling", None)
    theta = config.pop("rope_theta")
    if scaling and scaling["rope_type"] == "yarn":
        mscale = float(get("rope.scaling.yarn_log_multiplier", 0.0) or 0.0) / 0.1  # stored as 0.1·mscale_all_dim
        config["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": theta, "factor": scaling["factor"],
            "original_max_position_embeddings": scaling["original_max_position_embeddings"],
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0) or 32.0),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0) or 1.0),
            # the published models have mscale = mscale_all_dim (their ratio, YaRN's cos/sin factor, is 1)
            "mscale": mscale, "mscale_all_dim": mscale,
        }
    else:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return config


# llama.cpp names of the tensors only this family has → HF names (the shared map holds the rest)
_GGUF_EXTRA = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a.bias": "self_attn.q_a_proj.bias",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_mqa.bias": "self_attn.kv_a_proj_with_mqa.bias",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}


def sanitize_gguf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    main, extra, split_kv_b = {}, {}, {}
    for name, t in raw.items():
        parts = name.split(".", 2)
        if parts[0] == "blk" and parts[2] in _GGUF_EXTRA:
            extra[f"model.layers.{parts[1]}.{_GGUF_EXTRA[parts[2]]}"] = t
        elif parts[0] == "blk" and parts[2] in ("attn_k_b.weight", "attn_v_b.weight"):
            split_kv_b.setdefault(int(parts[1]), {})[parts[2][5]] = t  # "k" or "v"
        else:
            main[name] = t
    out = sanitize_moe_gguf(main, config)
    out.update(extra)
    for layer, halves in split_kv_b.items():
        k_b, v_b = halves["k"], halves["v"]  # (nh, r, dn), (nh, dv, r)
        kv_b = torch.cat((k_b.transpose(1, 2), v_b), dim=1)  # (nh, dn + dv, r): the HF per-head layout
        out[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1]).contiguous()
    config.pop("mlp_only_layers", None)  # first_k_dense_replace says which layers are dense
    config["n_routed_experts"] = config.pop("num_experts", None) or config["n_routed_experts"]
    return _to_rotate_half(out, config)
