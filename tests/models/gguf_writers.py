"""Write a transformers MoE model as llama.cpp would (names, metadata, q/k permutation), F32."""

from __future__ import annotations

from pathlib import Path

import numpy as np

_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert-time q/k row permutation for the `llama` architecture."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(model, path: Path, arch: str, per_expert: bool = False) -> Path:
    """arch: qwen3moe | olmoe | llama (Mixtral). per_expert: early Mixtral files' ffn_gate.{e} tensors."""
    import gguf

    c = model.config
    n_experts = getattr(c, "num_experts", None) or c.num_local_experts
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(n_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if hasattr(c, "norm_topk_prob"):
        w.add_expert_weights_norm(bool(c.norm_topk_prob))
    if getattr(c, "clip_qkv", None):
        w.add_clamp_kqv(float(c.clip_qkv))

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd.pop("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", sd.pop("model.norm.weight"))
    w.add_tensor("output.weight", sd.pop("lm_head.weight"))
    for name, t in sd.items():
        _, _, layer, rest = name.split(".", 3)
        if rest.endswith("mlp.experts.gate_up_proj"):
            inter = t.shape[1] // 2
            gate, up = t[:, :inter], t[:, inter:]
            down = sd[name.replace("gate_up_proj", "down_proj")]
            if per_expert:
                for e in range(t.shape[0]):
                    for kind, part in (("ffn_gate", gate), ("ffn_up", up), ("ffn_down", down)):
                        w.add_tensor(f"blk.{layer}.{kind}.{e}.weight", np.ascontiguousarray(part[e]))
            else:
                for kind, part in (("ffn_gate_exps", gate), ("ffn_up_exps", up), ("ffn_down_exps", down)):
                    w.add_tensor(f"blk.{layer}.{kind}.weight", np.ascontiguousarray(part))
            continue
        if rest.endswith("mlp.experts.down_proj"):
            continue
        module, suffix = rest.rsplit(".", 1)
        if arch == "llama" and module == "self_attn.q_proj":
            t = _permute(t, c.num_attention_heads)
        elif arch == "llama" and module == "self_attn.k_proj":
            t = _permute(t, c.num_key_value_heads)
        w.add_tensor(f"blk.{layer}.{_NAMES[module]}.{suffix}", np.ascontiguousarray(t))
    return finish(w, path)


def finish(w, path: Path) -> Path:
    """Header, metadata and tensors out, file closed: every test writer's last step."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_prediction_block(w, sd: dict, n_layers: int, hidden: int, names: dict) -> None:
    """The multi-token prediction block llama.cpp's converters keep after the last layer (GLM-4.5,
    Qwen3.5): a copy of the last block's attention and its own projection; Tandem drops it at load."""
    for name, t in sd.items():
        if name.startswith(f"model.layers.{n_layers - 1}.self_attn."):
            module, suffix = name.split(".", 3)[3].rsplit(".", 1)
            w.add_tensor(f"blk.{n_layers}.{names[module]}.{suffix}", np.ascontiguousarray(t))
    w.add_tensor(f"blk.{n_layers}.nextn.eh_proj.weight", np.zeros((hidden, 2 * hidden), np.float32))
