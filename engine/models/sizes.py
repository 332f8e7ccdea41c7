"""A model's parts in bytes from its shape alone (ModelArgs: GGUF metadata or config.json, no
tensor read), as the engine would hold them in one dtype: what the placement planner divides.

The count follows models/common.py's modules: per layer q/k/v/o projections (biases where the
family has them, attention sinks), two RMSNorms and the optional q/k norms, then either the router
(its biases), the shared experts and the experts' biases (MoE layers: dense weights, on the GPU
side) or the dense SwiGLU FFN; token embeddings, the final norm and the output projection unless tied.
A hybrid model (Qwen3.5) counts its linear-attention layers' own weights, KV for its full-attention
layers only, and a recurrent state per chat.
"""

from __future__ import annotations

from engine.kv.recurrent import STATES_PER_SEQUENCE
from engine.models.common import ModelArgs
from engine.sched.placement_speed import ModelParts


def _mla_attention(args: ModelArgs) -> int:
    """Parameters of one multi-head latent attention (engine/models/mla.py) and the block's two norms."""
    m, H, nh = args.mla, args.dim, args.n_heads
    q_width = nh * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    q = H * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * q_width if m.q_lora_rank else H * q_width
    latent = H * m.row_width + m.kv_lora_rank + m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim)
    biases = ((m.q_lora_rank or 0) + m.row_width if args.qkv_bias else 0) + (H if args.o_bias else 0)
    return q + latent + nh * m.v_head_dim * H + biases + 2 * H


def model_parts(args: ModelArgs, dtype_bytes: int, name: str) -> ModelParts:
    H, hs = args.dim, args.head_dim
    q, kv = args.n_heads * hs, args.n_kv_heads * hs
    attention = H * q + 2 * H * kv + q * H + 2 * H  # projections and the two norms
    if args.qkv_bias:
        attention += q + 2 * kv
    if args.o_bias:
        attention += H
    if args.qk_norm:
        attention += 2 * hs if args.qk_norm_scope == "head" else q + kv
    if args.attn_sinks:
        attention += args.n_heads  # one sink logit per head
    kv_rows = 2  # a K and a V per token and KV head
    mla = getattr(args, "mla", None)
    if mla is not None:  # one [latent, RoPE key] row per token: hs = r + dr, n_kv = 1, no V
        attention, kv_rows = _mla_attention(args), 1
        # absorbed attention per (query, key): nh·(r + dr) multiply-adds for the score, nh·r for the value
        q = args.n_heads * (mla.kv_lora_rank + mla.qk_rope_head_dim // 2)
    if args.attn_output_gate:  # q_proj also yields the per-head output gate
        attention += H * q
    moe = args.moe_layer_ids()
    dense_ffn = 3 * H * (args.ffn_dim or 0)
    # a MoE layer's dense part: the router (and its score bias) and the shared experts every token runs
    moe_dense = args.n_experts * H + 3 * H * args.shared_expert_ffn_dim
    if args.router_score_bias:
        moe_dense += args.n_experts
    if args.router_bias:
        moe_dense += args.n_experts
    if args.expert_bias:  # every expert's biases: small, kept with the dense weights on the device
        moe_dense += args.n_experts * (2 * args.expert_ffn_dim + H)
    if args.shared_expert_gate:
        moe_dense += H
    kv_layers = args.kv_layer_ids()
    linear = args.linear_attn  # hybrid models: the other layers mix by a recurrent state (models/gated_deltanet.py)
    mixer = [attention if linear is None or i in kv_layers else linear.params(H) + 2 * H for i in range(args.n_layers)]
    layer_params = [mixer[i] + (moe_dense if i in moe else dense_ffn) for i in range(args.n_layers)]
    mean_layer = sum(layer_params) // max(args.n_layers, 1)
    expert_params = 3 * H * (args.expert_ffn_dim or 0) if args.is_moe else 0
    return ModelParts(
        name=name, n_layers=args.n_layers,
        embed_bytes=(args.vocab_size * H + H) * dtype_bytes,
        output_bytes=0 if args.tie_embeddings else args.vocab_size * H * dtype_bytes,
        layer_dense_bytes=mean_layer * dtype_bytes,
        moe_layers=len(moe), n_experts=args.n_experts, top_k=args.top_k,
        expert_bytes=expert_params * dtype_bytes, expert_flops_per_token=2.0 * expert_params,
        kv_bytes_per_token=kv_rows * len(kv_layers) * kv * dtype_bytes,
        dense_flops_per_token=2.0 * sum(layer_params), attn_width=q, kv_layers=len(kv_layers),
        state_bytes_per_chat=recurrent_state_bytes(args))


def recurrent_state_bytes(args: ModelArgs) -> int:
    """One chat's recurrent state on the compute device (hybrid models; 0 for others): fp32 whatever
    the weights' dtype, the current state, the crop snapshots and the kept one (kv/recurrent.py)."""
    if args.linear_attn is None:
        return 0
    return (args.n_layers - len(args.kv_layer_ids())) * args.linear_attn.state_bytes() * STATES_PER_SEQUENCE
