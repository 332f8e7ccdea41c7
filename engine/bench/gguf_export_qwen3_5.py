"""GGUF export of Qwen3.5-MoE (llama.cpp arch `qwen35moe`): what the shared name map does not hold.

The inverse of the reader (engine/models/qwen3_5_moe_gguf.py), laid out as llama.cpp's converter
lays it out and its qwen35moe graph expects:

    engine tensor (model.layers.N.)          GGUF (blk.N.)            on the way out
    linear_attn.in_proj_qkv (C, H)            attn_qkv                 v rows tiled (below)
    linear_attn.in_proj_z (nv·dv, H)          attn_gate                rows tiled
    linear_attn.in_proj_b / in_proj_a (nv, H) ssm_beta / ssm_alpha     rows tiled
    linear_attn.conv1d (C, 1, K)              ssm_conv1d (C, K), F32   squeezed, v channels tiled
    linear_attn.dt_bias (nv,)                 ssm_dt.bias, F32         tiled
    linear_attn.A_log (nv,)                   ssm_a, F32               −exp(A_log), tiled
    linear_attn.norm (dv,)                    ssm_norm, F32            as stored (w, not 1 + w)
    linear_attn.out_proj (H, nv·dv)           ssm_out                  columns tiled
    post_attention_layernorm (H,)             post_attention_norm      (not ffn_norm)
    mlp.shared_experts.{gate,up,down}_proj    ffn_{gate,up,down}_shexp
    mlp.shared_expert_gate (1, H)             ffn_gate_inp_shexp (H,), F32

The rest (norms as 1 + w, attn_q with each head's [q | gate] as in the engine, q/k norms, router,
stacked experts) goes through the shared map as stored. "Tiled": ggml broadcasts each key head over
its value heads as [v0 of k0, k1, … | v1 of k0, k1, …], so the converter reorders the value heads
from the checkpoints' grouped order [k0: v0 v1 … | k1: v0 v1 …]; the same transpose with the two head
axes swapped is the reader's `grouped_heads`, reused here.

Metadata: the rotary dims (a quarter of each head), the multimodal RoPE sections llama.cpp requires
(for text tokens its three position ids are equal, so any sections that cover every rotary pair
compute plain RoPE), the ssm.* sizes, and which layers are recurrent (per layer, and the interval).
llama.cpp sizes a value head by `ssm.state_size` (the key head's size) when it loads, routes every
layer with a gated shared expert, and aborts on a model without a full-attention layer (a KV cache
of no layers: `synthetic:qwen3.5-35b-a3b-L1` … `-L3`); such models are refused.
"""

from __future__ import annotations

import torch

from engine.errors import UnsupportedModelError
from engine.models.common import ModelArgs
from engine.models.qwen3_5_moe import FULL_ATTENTION_INTERVAL, text_config
from engine.models.qwen3_5_moe_gguf import grouped_heads

ARCH = "qwen35moe"
CHECKS_ALL = False  # check() adds to the export's common checks (plain RoPE, no window, routing)


def check(args: ModelArgs, config: dict | None = None) -> None:
    """What llama.cpp's qwen35moe loader and graph need of the shape (the config adds nothing here)."""
    s = args.linear_attn
    if s is None or s.k_head_dim != s.v_head_dim:
        raise UnsupportedModelError("llama.cpp's qwen35moe loader sizes value heads by the key heads' size; "
                                    "this model's differ", "export a model with equal DeltaNet head sizes")
    if s.n_v_heads % s.n_k_heads:
        raise UnsupportedModelError(f"{s.n_v_heads} value heads do not share {s.n_k_heads} key heads evenly",
                                    "the model is not a Qwen3.5 shape")
    if not args.kv_layer_ids():  # (the first full layer of the presets is the fourth: -L4 and up)
        raise UnsupportedModelError("llama.cpp aborts on a qwen35moe model without a full-attention layer "
                                    "(its KV cache then has no buffer)", "export at least 4 layers")
    if not args.shared_expert_ffn_dim:
        raise UnsupportedModelError("llama.cpp's qwen35moe graph needs every layer's shared expert; this model "
                                    "has none", "export a model with a shared expert")


def tiled(t: torch.Tensor, dim: int, args: ModelArgs, head: int) -> torch.Tensor:
    """Value heads along `dim` (n_v·head entries) from grouped by key head (n_k, n_v/n_k, head) to
    tiled (n_v/n_k, n_k, head): `grouped_heads` read with n_v/n_k groups of n_k."""
    n_k, n_v = args.linear_attn.n_k_heads, args.linear_attn.n_v_heads
    return grouped_heads(t, dim, n_v // n_k, n_v, head)


def _qkv_tiled(t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """(C, …) with C = q rows, k rows (2·n_k·dk, kept), then v rows (tiled)."""
    s = args.linear_attn
    qk = 2 * s.n_k_heads * s.k_head_dim
    return torch.cat((t[:qk], tiled(t[qk:], 0, args, s.v_head_dim)))


# engine name under model.layers.N. → (GGUF kind, F32?, what to do to the tensor)
_LINEAR = {
    "linear_attn.in_proj_qkv.weight": ("attn_qkv.weight", False, _qkv_tiled),
    "linear_attn.in_proj_z.weight": ("attn_gate.weight", False,
                                     lambda t, a: tiled(t, 0, a, a.linear_attn.v_head_dim)),
    "linear_attn.in_proj_b.weight": ("ssm_beta.weight", False, lambda t, a: tiled(t, 0, a, 1)),
    "linear_attn.in_proj_a.weight": ("ssm_alpha.weight", False, lambda t, a: tiled(t, 0, a, 1)),
    # ggml_ssm_conv takes an F32 kernel, as the converter writes it
    "linear_attn.conv1d.weight": ("ssm_conv1d.weight", True, lambda t, a: _qkv_tiled(t.squeeze(1), a)),
    "linear_attn.dt_bias": ("ssm_dt.bias", True, lambda t, a: tiled(t, 0, a, 1)),
    "linear_attn.A_log": ("ssm_a", True, lambda t, a: tiled(-t.float().exp(), 0, a, 1)),
    "linear_attn.norm.weight": ("ssm_norm.weight", True, None),
    "linear_attn.out_proj.weight": ("ssm_out.weight", False, lambda t, a: tiled(t, 1, a, a.linear_attn.v_head_dim)),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", True, None),
    "mlp.shared_experts.gate_proj.weight": ("ffn_gate_shexp.weight", False, None),
    "mlp.shared_experts.up_proj.weight": ("ffn_up_shexp.weight", False, None),
    "mlp.shared_experts.down_proj.weight": ("ffn_down_shexp.weight", False, None),
    # (1, H) → (H,): llama.cpp multiplies the vector into one scalar per token; F32 like every router
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight", True, lambda t, a: t.reshape(-1)),
}


# the export's table (engine/bench/gguf_export.py layer_pieces): each engine name to its one GGUF piece
LAYER_TENSORS = {name: [piece] for name, piece in _LINEAR.items()}


def rope_sections(config: dict, rotary_dim: int) -> list[int]:
    """The four multimodal RoPE sections (rotary pairs per position id: time, height, width, extra).

    llama.cpp's interleaved layout gives rotary pair p to position id p mod 3 while p < 3·section of
    that id, else to the fourth id, which is 0 for text tokens (the pair would not turn). The
    config's `mrope_section` where it covers every pair (the release: [11, 11, 10] of 32), else the
    split that does.
    """
    pairs = rotary_dim // 2

    def covers(sections):
        return all(p < 3 * sections[p % 3] for p in range(pairs))

    given = list((config.get("rope_parameters") or {}).get("mrope_section") or [])
    if len(given) == 3 and sum(given) == pairs and covers(given):
        return given + [0]
    return [(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3, 0]


def metadata(w, args: ModelArgs, config: dict) -> None:
    """qwen35moe's own keys (the shared ones are written by the caller)."""
    config = text_config(config)
    s = args.linear_attn
    w.add_expert_feed_forward_length(args.expert_ffn_dim)
    w.add_expert_shared_feed_forward_length(args.shared_expert_ffn_dim)
    w.add_rope_dimension_sections(rope_sections(config, args.rotary_dim))
    w.add_ssm_conv_kernel(s.conv_kernel)
    w.add_ssm_state_size(s.k_head_dim)
    w.add_ssm_group_count(s.n_k_heads)
    w.add_ssm_time_step_rank(s.n_v_heads)
    w.add_ssm_inner_size(s.n_v_heads * s.v_head_dim)
    w.add_full_attention_interval(int(config.get("full_attention_interval") or FULL_ATTENTION_INTERVAL))
    # per layer, whatever the interval says: exact for models with their own layer_types
    full = set(args.kv_layer_ids())
    w.add_array(f"{ARCH}.attention.recurrent_layers", [i not in full for i in range(args.n_layers)])
