"""Reading the config.json fields that several families spell alike: sizes, EOS ids, RoPE, sparse layers.

Configs come in two generations: transformers ≤ 4.x writes `rope_theta` and `rope_scaling`, 5.x
writes `rope_parameters` ({"rope_type", "rope_theta", …}). Both are read. Scaled RoPE variants whose
frequencies are fixed at load (linear, YaRN, llama3) take their inverse frequencies from
transformers' own `ROPE_INIT_FUNCTIONS`, the oracle the parity tests compare with; variants that
change with the sequence length are refused with a clear error.
"""

from __future__ import annotations

import torch

from engine.errors import UnsupportedModelError

STATIC_ROPE_TYPES = ("linear", "yarn", "llama3")  # frequencies fixed at load time


def eos_list(config: dict) -> list[int]:
    eos = config.get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else [int(e) for e in eos])


def expert_count(config: dict) -> int:
    """Routed experts per MoE layer, under any of the spellings configs use (transformers 5.x writes
    `num_local_experts` for every family; the published Qwen/OLMoE files say `num_experts`)."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def rope_settings(config: dict, default_theta: float) -> tuple[float, torch.Tensor | None, float]:
    """(θ, inverse frequencies (hs/2,) or None for plain RoPE, cos/sin attention factor)."""
    params = dict(config.get("rope_parameters") or {})
    legacy = dict(config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta") or config.get("rope_theta") or default_theta)
    kind = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if kind == "default":
        return theta, None, 1.0
    if kind not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling '{kind}' of this {config.get('model_type')} model is not supported",
            f"use a model with plain RoPE or one of: {', '.join(STATIC_ROPE_TYPES)} "
            "(or remove rope_scaling from config.json to run at the original context length)")
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](hf_config, None)
    return theta, inv_freq.float(), float(attention_factor)


def sparse_layer_ids(n_layers: int, mlp_only_layers, decoder_sparse_step: int | None) -> list[int] | None:
    """Layers with routed experts under Qwen-MoE's rule (a layer is sparse unless listed in
    mlp_only_layers, and only every decoder_sparse_step-th layer is); None when every layer is."""
    step = int(decoder_sparse_step or 1)
    dense = set(mlp_only_layers or ())
    ids = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
    return None if len(ids) == n_layers else ids


def sliding_window(config: dict, enabled_key: str | None = None) -> int | None:
    """The configured attention window, or None. Qwen-MoE configs gate it with `use_sliding_window`."""
    if enabled_key is not None and not config.get(enabled_key, False):
        return None
    window = config.get("sliding_window")
    return int(window) if window else None


def decoder_args(config: dict, *, arch: str, default_theta: float, default_eps: float = 1e-5,
                 default_max_position: int = 4096) -> dict:
    """The ModelArgs fields every decoder family reads the same way (sizes, RoPE, norms, token ids);
    a family adds its own (head dim, FFN, attention extras, experts) and builds ModelArgs from both."""
    n_heads = config["num_attention_heads"]
    theta, inv_freq, attention_factor = rope_settings(config, default_theta=default_theta)
    return dict(
        arch=arch,
        vocab_size=config["vocab_size"],
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        rope_theta=float(theta),
        rope_inv_freq=inv_freq,
        rope_attention_factor=attention_factor,
        norm_eps=config.get("rms_norm_eps", default_eps),
        max_position=config.get("max_position_embeddings", default_max_position),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_list(config),
    )
