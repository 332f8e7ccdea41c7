"""Qwen3.5-MoE in GGUF (llama.cpp arch `qwen35moe`): metadata → config keys, tensor names → HF names.

Names and conventions as llama.cpp's converter writes them (its conversion/qwen.py, Qwen3_5MoeTextModel):
  - full-attention layers use the common names (attn_q holds q and its gate, interleaved per head as
    in the checkpoints); the block's second norm is `post_attention_norm`;
  - DeltaNet layers: attn_qkv (in_proj_qkv), attn_gate (in_proj_z), ssm_beta / ssm_alpha (in_proj_b /
    in_proj_a), ssm_conv1d (C, K), ssm_dt.bias (dt_bias), ssm_a = −exp(A_log), ssm_norm, ssm_out;
  - the shared expert `ffn_*_shexp` and its gate `ffn_gate_inp_shexp` (H,);
  - every (1 + w) RMSNorm is stored as 1 + w already (the engine's form), the DeltaNet's norm as w;
  - where value heads outnumber key heads, the converter reorders the value heads from grouped by
    key head ([k0: v0 v1 | k1: v0 v1 …]) to tiled ([v0 of k0, k1, … | v1 of k0, k1, …]) for ggml's
    broadcast; the rows and columns are put back in grouped order here;
  - block_count includes the multi-token-prediction layers (`nextn_predict_layers`), dropped;
  - experts come as ffn_gate_exps / ffn_up_exps / ffn_down_exps, or fused ffn_gate_up_exps (gate rows first).
"""

from __future__ import annotations

import torch

from engine.models.gguf_names import moe_config_from_gguf, sanitize_moe_gguf
from engine.quant.blocks import QuantTensor

NAME = "qwen3_5_moe"


def config_from_gguf(meta: dict) -> dict:
    a = meta["general.architecture"]

    def get(key, default=None):
        return meta.get(f"{a}.{key}", default)

    config = moe_config_from_gguf(meta, NAME)
    nextn = int(get("nextn_predict_layers", 0) or 0)
    n_layers = config["num_hidden_layers"] - nextn
    config["num_hidden_layers"] = n_layers
    head_dim = config["head_dim"]
    config["partial_rotary_factor"] = int(get("rope.dimension_count", head_dim // 4)) / head_dim
    n_v = int(get("ssm.time_step_rank"))
    config.update(
        shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0) or 0),
        linear_conv_kernel_dim=int(get("ssm.conv_kernel", 4)),
        linear_key_head_dim=int(get("ssm.state_size")),
        linear_num_key_heads=int(get("ssm.group_count")),
        linear_num_value_heads=n_v,
        linear_value_head_dim=int(get("ssm.inner_size")) // n_v,
    )
    recurrent = get("attention.recurrent_layers")
    if recurrent is not None:
        config["layer_types"] = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:n_layers]]
    else:
        interval = int(get("full_attention_interval", 4) or 4)
        config["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                 for i in range(n_layers)]
    return config


def grouped_heads(t: torch.Tensor, dim: int, n_k: int, n_v: int, head: int) -> torch.Tensor:
    """Undo the converter's value-head reordering along `dim` (n_v·head entries): tiled
    (n_v/n_k, n_k, head) back to grouped (n_k, n_v/n_k, head)."""
    if n_k == n_v:
        return t
    shape = list(t.shape)
    t = t.reshape(shape[:dim] + [n_v // n_k, n_k, head] + shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape).contiguous()


# llama.cpp names of tensors beyond the shared map → (HF name under model.layers.{i}., what to do)
_LINEAR = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
_EXTRA = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}


_ROW_RELAID = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight")


def _linear_tensor(kind: str, t: torch.Tensor, config: dict) -> torch.Tensor:
    if isinstance(t, QuantTensor):  # blocks the loader kept: they select whole rows only
        if kind in _ROW_RELAID:  # the same re-lay of a row-number column, then those rows of the blocks
            return t[_linear_tensor(kind, torch.arange(t.shape[0]).reshape(-1, 1), config).reshape(-1)]
        t = t.dequantize()  # ssm_out's columns, the conv: re-laid as floats
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    qk = 2 * n_k * dk  # q and k rows (conv channels) come first and keep their order
    if kind == "attn_qkv.weight":
        return torch.cat((t[:qk], grouped_heads(t[qk:], 0, n_k, n_v, dv)))
    if kind == "ssm_conv1d.weight":  # (C, K) → (C, 1, K)
        return torch.cat((t[:qk], grouped_heads(t[qk:], 0, n_k, n_v, dv))).unsqueeze(1)
    if kind == "attn_gate.weight":
        return grouped_heads(t, 0, n_k, n_v, dv)
    if kind == "ssm_out.weight":
        return grouped_heads(t, 1, n_k, n_v, dv)
    if kind in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias"):
        return grouped_heads(t, 0, n_k, n_v, 1)
    if kind == "ssm_a":  # stored as −exp(A_log)
        return torch.log(-grouped_heads(t.reshape(-1), 0, n_k, n_v, 1))
    return t


def sanitize_gguf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    n_layers = int(config["num_hidden_layers"])
    fused = {name.split(".")[1] for name in raw if name.endswith(".ffn_gate_up_exps.weight")}
    main, extra = {}, {}
    for name, t in raw.items():
        parts = name.split(".", 2)
        if parts[0] == "blk":
            layer = int(parts[1])
            if layer >= n_layers:
                continue  # the multi-token-prediction block
            kind, prefix = parts[2], f"model.layers.{layer}."
            if kind in _LINEAR:
                extra[prefix + _LINEAR[kind]] = _linear_tensor(kind, t, config)
                continue
            if kind in _EXTRA:
                extra[prefix + _EXTRA[kind]] = t.reshape(1, -1) if kind.startswith("ffn_gate_inp_shexp") else t
                continue
            if kind == "ffn_gate_up_exps.weight":  # (E, 2I, H) gate first: the engine's layout
                extra[prefix + "mlp.experts.gate_up_proj"] = t
                continue
            if kind == "ffn_down_exps.weight" and parts[1] in fused:  # (its gate and up are not for the shared map)
                extra[prefix + "mlp.experts.down_proj"] = t
                continue
        main[name] = t
    out = sanitize_moe_gguf(main, config)
    out.update(extra)
    config.pop("mlp_only_layers", None)  # every layer routes; a layer without stacked gate/up is fused above
    first = out.get("model.layers.0.mlp.experts.gate_up_proj")
    if first is not None:
        config["num_experts"] = config.get("num_experts") or first.shape[0]
        config["moe_intermediate_size"] = first.shape[1] // 2
    return out
