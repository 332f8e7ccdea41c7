"""llama.cpp tensor names and metadata of MoE decoders → Hugging Face names and config keys.

Shared by the MoE families that have a GGUF form (qwen3moe, olmoe, and Mixtral, which llama.cpp
files under the `llama` architecture with an expert count). Experts come stacked per layer
(`ffn_gate_exps` (E, I, H) …) or, in early Mixtral files, one by one (`ffn_gate.{e}`); both end in
the engine's fused layout (see expert_names.py).
"""

from __future__ import annotations

import torch

from engine.errors import ModelFileError
from engine.models.expert_names import fuse_gguf_experts

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate": "mlp.gate_proj",  # dense layers
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Stacked routed experts: GGUF kind → role in the engine's fused layout (gate/up rows of gate_up_proj, down_proj).
_EXPERT_KINDS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}


def gguf_name(hf_name: str) -> str:
    """The inverse of the mapping below for one non-expert tensor: HF name → llama.cpp name
    (`model.layers.3.self_attn.q_proj.weight` → `blk.3.attn_q.weight`). What a GGUF writer uses."""
    for g, hf in _GLOBAL_NAMES.items():
        if hf == hf_name:
            return g
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) >= 5:
        module, suffix = ".".join(parts[3:-1]), parts[-1]
        for kind, hf_module in _LAYER_NAMES.items():
            if hf_module == module:
                return f"blk.{parts[2]}.{kind}.{suffix}"
    raise ModelFileError(f"tensor {hf_name} has no llama.cpp name",
                         "only the tensors of Tandem's MoE families can be written as GGUF")


def gguf_expert_names(layer: int) -> dict[str, str]:
    """Role (gate, up, down) → llama.cpp name of one layer's stacked expert tensor."""
    return {role: f"blk.{layer}.{kind}.weight" for kind, role in _EXPERT_KINDS.items()}


def moe_config_from_gguf(meta: dict, model_type: str) -> dict:
    """HF-style config keys every llama.cpp MoE decoder shares."""
    a = meta["general.architecture"]
    n_heads = int(meta[f"{a}.attention.head_count"])
    dim = int(meta[f"{a}.embedding_length"])

    def get(key, default=None):
        return meta.get(f"{a}.{key}", default)

    config = {
        "model_type": model_type,
        "vocab_size": int(get("vocab_size", 0)) or None,
        "hidden_size": dim,
        "num_hidden_layers": int(meta[f"{a}.block_count"]),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(get("attention.key_length", 0) or get("rope.dimension_count", 0) or dim // n_heads),
        "intermediate_size": int(get("feed_forward_length", 0)) or None,
        "moe_intermediate_size": int(get("expert_feed_forward_length", 0)) or None,
        "num_experts": int(get("expert_count", 0)),
        "num_experts_per_tok": int(get("expert_used_count", 0)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(get("rope.scaling.factor", 1.0)),
                                  "original_max_position_embeddings":
                                      int(get("rope.scaling.original_context_length", config["max_position_embeddings"]))}
    if get("attention.sliding_window"):
        config["sliding_window"] = int(get("attention.sliding_window"))
    return config


def sanitize_moe_gguf(raw: dict[str, torch.Tensor], config: dict, unpermute_qk=None) -> dict[str, torch.Tensor]:
    """GGUF names → HF names with fused experts; fills the config keys only the tensors tell
    (vocab size, tied head, expert FFN size, which layers are dense). `unpermute_qk(w, n_heads)`
    undoes llama.cpp's q/k row permutation for families stored under the `llama` architecture."""
    out: dict[str, torch.Tensor] = {}
    stacked: dict[int, dict[str, torch.Tensor]] = {}  # layer → gate/up/down → (E, …)
    single: dict[int, dict[str, dict[int, torch.Tensor]]] = {}  # early Mixtral: layer → role → expert
    for name, t in raw.items():
        if name in _GLOBAL_NAMES:
            out[_GLOBAL_NAMES[name]] = t
        elif name.startswith("blk."):
            parts = name.split(".")
            layer, kind = int(parts[1]), parts[2]
            if kind in _EXPERT_KINDS:
                stacked.setdefault(layer, {})[_EXPERT_KINDS[kind]] = t
            elif kind in ("ffn_gate", "ffn_up", "ffn_down") and len(parts) == 5 and parts[3].isdigit():
                single.setdefault(layer, {}).setdefault(kind[4:], {})[int(parts[3])] = t
            elif kind in _LAYER_NAMES:
                if unpermute_qk is not None and kind == "attn_q":
                    t = unpermute_qk(t, config["num_attention_heads"])
                elif unpermute_qk is not None and kind == "attn_k":
                    t = unpermute_qk(t, config["num_key_value_heads"])
                out[f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{parts[-1]}"] = t
            # other blk.* tensors (rope_freqs …) are recomputed from the config
    for layer, roles in single.items():
        for role, experts in roles.items():
            stacked.setdefault(layer, {})[role] = torch.stack([experts[e] for e in sorted(experts)])
    for layer, roles in stacked.items():
        if set(roles) != {"gate", "up", "down"}:
            raise ModelFileError(f"layer {layer} has expert tensors {sorted(roles)} but needs gate, up and down",
                                 "the GGUF file is incomplete: re-download or re-convert it")
        p = f"model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = fuse_gguf_experts(roles["gate"], roles["up"])  # (E, 2I, H)
        out[p + "down_proj"] = roles["down"]  # (E, H, I)

    if "lm_head.weight" not in out:
        config["tie_word_embeddings"] = True
    if not config.get("vocab_size"):
        config["vocab_size"] = out["model.embed_tokens.weight"].shape[0]
    if stacked:
        first = stacked[min(stacked)]
        config["num_experts"] = config.get("num_experts") or first["gate"].shape[0]
        config["moe_intermediate_size"] = first["gate"].shape[1]  # the tensors are the authority
    dense = [i for i in range(config["num_hidden_layers"]) if i not in stacked]
    if dense and stacked:
        config["mlp_only_layers"] = dense
    return out
