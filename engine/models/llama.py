"""Llama-family dense decoder (Llama 2/3, SmolLM2, …): config, name mapping, routing rule.

The forward is `common.Decoder`: embed → [x + attn(norm(x)); h + ffn(norm(h))] × L → norm → head.
GGUF files store q/k rows permuted for llama.cpp's interleaved RoPE; `sanitize_gguf` undoes that so
one rotate-half RoPE serves GGUF and safetensors alike.
"""

from __future__ import annotations

import torch

from engine.models.common import ModelArgs
from engine.models.moe_ffn import SoftmaxTopK
from engine.models.gguf_names import sanitize_moe_gguf
from engine.models.hf_config import decoder_args

NAME = "llama"
GGUF_ARCHS = {"llama"}
MODEL_TYPES = {"llama"}


def config_from_gguf(meta: dict) -> dict:
    a = meta["general.architecture"]
    n_heads = int(meta[f"{a}.attention.head_count"])
    dim = int(meta[f"{a}.embedding_length"])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return {
        "model_type": "llama",
        "vocab_size": int(meta.get(f"{a}.vocab_size", 0)) or None,
        "hidden_size": dim,
        "num_hidden_layers": int(meta[f"{a}.block_count"]),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv", n_heads)),
        "head_dim": int(meta.get(f"{a}.rope.dimension_count", dim // n_heads)),
        "intermediate_size": int(meta[f"{a}.feed_forward_length"]),
        "rope_theta": float(meta.get(f"{a}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(meta.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(meta.get(f"{a}.context_length", 4096)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
    }


def args_from_config(config: dict) -> ModelArgs:
    base = decoder_args(config, arch=NAME, default_theta=10000.0)  # RoPE: plain, llama3, linear, …
    return ModelArgs(
        **base,
        head_dim=config.get("head_dim") or base["dim"] // base["n_heads"],
        ffn_dim=config["intermediate_size"],
    )


route = SoftmaxTopK(always=True)  # the upcycled MoE variant's: always renormalised, the flag ignored


def _unpermute(w, n_heads: int):
    """Inverse of llama.cpp's convert-time q/k row permutation (interleaved → rotate-half pairs): a
    selection of whole rows, so a tensor or quantised blocks (engine/quant) alike."""
    out_dim = w.shape[0]
    rows = torch.arange(out_dim).reshape(n_heads, out_dim // n_heads // 2, 2).transpose(1, 2).reshape(out_dim)
    return w[rows]


def sanitize_gguf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """llama.cpp names → HF names through the map the MoE families share (a dense file has no expert
    tensors); q/k rows come back from llama.cpp's interleaved order."""
    return sanitize_moe_gguf(raw, config, unpermute_qk=_unpermute)


def sanitize_hf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in raw.items() if "rotary_emb.inv_freq" not in k}
