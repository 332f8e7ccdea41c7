"""GGUF export of DeepSeek-V2 / V2-Lite (llama.cpp arch `deepseek2`): what the shared name map does not hold.

The inverse of the reader (engine/models/deepseek_v2.py: config_from_gguf, sanitize_gguf), in the
form llama.cpp's current converter writes and its deepseek2 graph runs as absorbed MLA (a KV cache of
one [latent, RoPE key] row per token, as Tandem's):

    engine tensor (model.layers.N.)              GGUF (blk.N.)                on the way out
    self_attn.q_proj (nh·(dn + dr), H)           attn_q                       RoPE rows interleaved
    self_attn.q_a_proj (q_rank, H)               attn_q_a                     (q LoRA only)
    self_attn.q_a_layernorm (q_rank,)            attn_q_a_norm, F32
    self_attn.q_b_proj (nh·(dn + dr), q_rank)    attn_q_b                     RoPE rows interleaved
    self_attn.kv_a_proj_with_mqa (r + dr, H)     attn_kv_a_mqa                RoPE rows interleaved
    self_attn.kv_a_layernorm (r,)                attn_kv_a_norm, F32
    self_attn.kv_b_proj (nh·(dn + dv), r)        attn_k_b (nh, r, dn)         K half, transposed
                                                 attn_v_b (nh, dv, r)         V half
    mlp.shared_experts.{gate,up,down}_proj       ffn_{gate,up,down}_shexp

The rest (norms, attn_output, the dense layers' ffn_*, the router, stacked experts) goes through
the shared map as stored.

RoPE. llama.cpp's deepseek2 rotates interleaved pairs (x0, x1), (x2, x3)… (LLAMA_ROPE_TYPE_NORM),
as the checkpoints lay out the last dr rows of each query head and of the latent row; the engine
keeps those rows in rotate-half order (engine/models/mla.py). `interleave_rope_rows` undoes the
reader's `deinterleave_rope_rows` exactly (a permutation of rows), so a file read back holds the
same tensors.

kv_b. llama.cpp of this generation loads `attn_k_b` + `attn_v_b` when the file records MLA's per-head
widths (`key_length_mla`, `value_length_mla`) and runs the absorbed graph over a K-only cache;
without them it wants the whole `attn_kv_b` and caches per-head K and V (nh·(dn + dr + dv) per token
and layer: 20× the latent row in V2-Lite). The export writes the split form only.

Metadata: head_count_kv 1, key_length r + dr and value_length r (the cached row and its latent
part), the *_mla widths, kv_lora_rank, q_lora_rank (0: no q LoRA; llama.cpp reads the key unless
the model has 26 or 27 layers, which it takes for V2-Lite and then expects no q LoRA), the leading
dense block count, expert and shared-expert sizes, routed_scaling_factor as expert_weights_scale,
softmax gating, no top-k renormalisation, and YaRN's keys: type, factor, original context, betas,
and mscale_all_dim as 0.1·mscale_all_dim in `rope.scaling.yarn_log_multiplier` (llama.cpp divides
it back). llama.cpp then scales the softmax by (0.1·mscale_all_dim·ln factor + 1)² and leaves
cos/sin unscaled, as Tandem does when mscale equals mscale_all_dim (the published models); models
whose YaRN factors differ otherwise are refused, as are what llama.cpp's graph lacks: attention
biases, and group-limited routing (llama.cpp ranks a group by the sum of its two best experts,
DeepSeek-V3's rule; V2 ranks it by its best).
"""

from __future__ import annotations

import torch

from engine.errors import UnsupportedModelError
from engine.models.common import ModelArgs

ARCH = "deepseek2"
CHECKS_ALL = True  # YaRN and routing of its own: check() is the family's whole check
LITE_LAYER_COUNTS = (26, 27)  # llama.cpp skips q_lora_rank for these block counts (its V2-Lite test)


def interleave_rope_rows(weight: torch.Tensor, n_groups: int, group_width: int, rope_dim: int) -> torch.Tensor:
    """Rows (n_groups·group_width, …) whose last rope_dim rows of each group are in rotate-half order
    (pair i's two elements at i and rope_dim/2 + i) → interleaved pairs (at 2i and 2i + 1)."""
    grouped = weight.reshape(n_groups, group_width, *weight.shape[1:])
    start, half = group_width - rope_dim, rope_dim // 2
    order = torch.stack((torch.arange(half), torch.arange(half, rope_dim)), dim=1).reshape(-1) + start
    order = order.to(weight.device)
    out = grouped.clone()
    out[:, start:] = grouped[:, order]
    return out.reshape(weight.shape)


def _rope_params(config: dict) -> dict:
    return dict(config.get("rope_parameters") or config.get("rope_scaling") or {})


def _rope_kind(config: dict) -> str:
    params = _rope_params(config)
    return params.get("rope_type") or params.get("type") or "default"


def first_dense(args: ModelArgs) -> int:
    """Leading dense layers: the MoE layers must be all the others (llama.cpp's one count)."""
    moe = args.moe_layer_ids()
    lead = args.n_layers - len(moe)
    if list(moe) != list(range(lead, args.n_layers)):
        raise UnsupportedModelError(f"this model's MoE layers {list(moe)} do not follow its dense ones",
                                    "llama.cpp's deepseek2 graph knows a count of leading dense layers only")
    return lead


def check(args: ModelArgs, config: dict) -> None:
    m = getattr(args, "mla", None)
    if m is None:
        raise UnsupportedModelError("this model has no multi-head latent attention", "not a DeepSeek-V2 shape")
    if args.qkv_bias or args.o_bias:
        raise UnsupportedModelError("llama.cpp's deepseek2 graph has no attention biases; this model has them",
                                    "the two would compute different models")
    if args.router_groups > 1 and args.router_groups_used < args.router_groups:
        raise UnsupportedModelError(
            "this model routes within groups of experts ranked by their best expert (DeepSeek-V2); "
            "llama.cpp ranks groups by their two best", "export a model with greedy top-k (V2-Lite)")
    if m.q_lora_rank and args.n_layers in LITE_LAYER_COUNTS:
        raise UnsupportedModelError(f"llama.cpp takes a {args.n_layers}-layer deepseek2 file for V2-Lite and "
                                    "reads no q LoRA from it; this model has one", "export another layer count")
    shared = args.shared_expert_ffn_dim
    if args.moe_layer_ids() and (not shared or shared % args.expert_ffn_dim):
        raise UnsupportedModelError("llama.cpp's deepseek2 graph runs whole shared experts of the routed "
                                    "experts' size in every MoE layer; this model's differ",
                                    "export a model with n_shared_experts ≥ 1")
    first_dense(args)
    kind = _rope_kind(config)
    if kind == "default":
        return
    params = _rope_params(config)
    if kind != "yarn":
        raise UnsupportedModelError(f"the export writes plain or YaRN RoPE for deepseek2; this model's is '{kind}'",
                                    "export a model with plain or YaRN RoPE")
    if not params.get("mscale_all_dim") or abs(args.rope_attention_factor - 1.0) > 1e-6:
        raise UnsupportedModelError(
            "llama.cpp's deepseek2 applies YaRN's mscale_all_dim to the softmax and leaves cos/sin unscaled; "
            "this model's mscale and mscale_all_dim differ (or it has none)", "the two would compute different models")
    if params.get("truncate") is False:
        raise UnsupportedModelError("this model's YaRN does not round its correction range; llama.cpp's does",
                                    "the two would compute different models")


def metadata(w, args: ModelArgs, config: dict) -> None:
    """deepseek2's own keys (the shared ones, key_length r + dr among them, are the caller's)."""
    import gguf

    m = args.mla
    w.add_value_length(m.kv_lora_rank)  # values are the latent columns of each cached row
    w.add_key_length_mla(m.qk_nope_head_dim + m.qk_rope_head_dim)
    w.add_value_length_mla(m.v_head_dim)
    w.add_kv_lora_rank(m.kv_lora_rank)
    w.add_q_lora_rank(m.q_lora_rank or 0)
    w.add_feed_forward_length(args.ffn_dim or args.expert_ffn_dim)  # the dense layers' SwiGLU
    w.add_leading_dense_block_count(first_dense(args))
    w.add_expert_feed_forward_length(args.expert_ffn_dim)
    w.add_expert_shared_count(args.shared_expert_ffn_dim // args.expert_ffn_dim if args.expert_ffn_dim else 0)
    w.add_expert_weights_scale(float(args.routed_scaling))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    if _rope_kind(config) == "yarn":
        params = _rope_params(config)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(params["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(params["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(params.get("beta_fast") or 32.0))
        w.add_rope_scaling_yarn_beta_slow(float(params.get("beta_slow") or 1.0))
        w.add_rope_scaling_yarn_log_mul(0.1 * float(params["mscale_all_dim"]))  # the converter's factor 0.1


def _kv_b_half(t: torch.Tensor, args: ModelArgs, which: str) -> torch.Tensor:
    """kv_b (nh·(dn + dv), r) → attn_k_b (nh, r, dn) or attn_v_b (nh, dv, r)."""
    m = args.mla
    dn = m.qk_nope_head_dim
    per_head = t.reshape(args.n_heads, dn + m.v_head_dim, m.kv_lora_rank)  # (nh, dn + dv, r)
    return per_head[:, :dn].transpose(1, 2) if which == "k" else per_head[:, dn:]


def _q_rows(t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    m = args.mla
    return interleave_rope_rows(t, args.n_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_rope_head_dim)


def _latent_rows(t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    return interleave_rope_rows(t, 1, args.mla.row_width, args.mla.qk_rope_head_dim)


# engine name under model.layers.N. → [(GGUF kind, F32?, what to do to the tensor)]
_OWN = {
    "self_attn.q_proj.weight": [("attn_q.weight", False, _q_rows)],
    "self_attn.q_a_proj.weight": [("attn_q_a.weight", False, None)],
    "self_attn.q_a_layernorm.weight": [("attn_q_a_norm.weight", True, None)],
    "self_attn.q_b_proj.weight": [("attn_q_b.weight", False, _q_rows)],
    "self_attn.kv_a_proj_with_mqa.weight": [("attn_kv_a_mqa.weight", False, _latent_rows)],
    "self_attn.kv_a_layernorm.weight": [("attn_kv_a_norm.weight", True, None)],
    "self_attn.kv_b_proj.weight": [("attn_k_b.weight", False, lambda t, a: _kv_b_half(t, a, "k")),
                                   ("attn_v_b.weight", False, lambda t, a: _kv_b_half(t, a, "v"))],
    "mlp.shared_experts.gate_proj.weight": [("ffn_gate_shexp.weight", False, None)],
    "mlp.shared_experts.up_proj.weight": [("ffn_up_shexp.weight", False, None)],
    "mlp.shared_experts.down_proj.weight": [("ffn_down_shexp.weight", False, None)],
}


LAYER_TENSORS = _OWN  # the export's table (engine/bench/gguf_export.py layer_pieces)
