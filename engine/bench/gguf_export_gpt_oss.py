"""GGUF export of gpt-oss (llama.cpp arch `gpt-oss`): what the shared name map does not hold.

    engine tensor (model.layers.N.)       GGUF (blk.N.)                             on the way out
    self_attn.sinks (nh,)                 attn_sinks.weight, F32
    post_attention_layernorm (H,)         post_attention_norm.weight, F32           (its own name)
    mlp.expert_gate_up_bias (E, 2I)       ffn_gate_exps.bias, ffn_up_exps.bias, F32  gate half, up half
    mlp.expert_down_bias (E, H)           ffn_down_exps.bias, F32

The projections' own biases and everything else go through the shared map. llama.cpp's graph slides
one window over the even layers and fixes the clamped SwiGLU at alpha 1.702 and limit 7; models that
differ are refused, as they would compute something else there. YaRN's keys are written as the
checkpoint's config gives them.
"""

from __future__ import annotations

import torch

from engine.errors import UnsupportedModelError
from engine.models.common import ModelArgs

ARCH = "gpt-oss"
CHECKS_ALL = True  # YaRN, windows and routing of its own: check() is the family's whole check
SWIGLU = (1.702, 7.0)  # alpha and limit llama.cpp's gpt-oss graph hard-codes (ggml_swiglu_oai)


def check(args: ModelArgs, config: dict) -> None:
    windows = args.layer_windows or [None] * args.n_layers
    even_slide = all((w is not None) == (i % 2 == 0) for i, w in enumerate(windows))
    if not even_slide or len({w for w in windows if w}) > 1:
        raise UnsupportedModelError("llama.cpp's gpt-oss graph slides one window over the even layers only; "
                                    "this model's layers differ", "export a model with that pattern")
    if (args.expert_alpha, args.expert_limit) != SWIGLU:
        raise UnsupportedModelError(f"llama.cpp's gpt-oss graph fixes the SwiGLU's alpha and limit at {SWIGLU}; "
                                    f"this model has ({args.expert_alpha}, {args.expert_limit})",
                                    "the two would compute different models")


def metadata(w, args: ModelArgs, config: dict) -> None:
    """gpt-oss's own keys (the shared ones are written by the caller)."""
    import gguf

    w.add_feed_forward_length(args.expert_ffn_dim)
    w.add_expert_feed_forward_length(args.expert_ffn_dim)
    w.add_sliding_window(int(args.sliding_window or 0))
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1.0)))


def _half(t: torch.Tensor, which: int) -> torch.Tensor:
    """The gate (0) or up (1) half of a fused (E, 2I) bias, gate first."""
    half = t.shape[1] // 2
    return t[:, which * half:(which + 1) * half]


# engine name under model.layers.N. → [(GGUF kind, F32?, what to do to the tensor)] (gguf_export.py's table)
LAYER_TENSORS = {
    "self_attn.sinks": [("attn_sinks.weight", True, None)],
    "post_attention_layernorm.weight": [("post_attention_norm.weight", True, None)],
    "mlp.expert_gate_up_bias": [("ffn_gate_exps.bias", True, lambda t, a: _half(t, 0)),
                                ("ffn_up_exps.bias", True, lambda t, a: _half(t, 1))],
    "mlp.expert_down_bias": [("ffn_down_exps.bias", True, None)],
}
