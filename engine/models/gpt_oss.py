"""gpt-oss (gpt-oss-20b, gpt-oss-120b; transformers `gpt_oss`, llama.cpp `gpt-oss`): config, names, routing.

The forward is `common.Decoder`; one block reads

    a = attn(norm(x))       q, k, v, o with biases; RoPE with YaRN scaling; every softmax also holds a
                            learned per-head *sink* logit (a key with a zero value, so the weights of
                            the real keys sum to less than one); layers alternate a 128-token sliding
                            window (`layer_types` "sliding_attention") with full attention
    h = x + a
    y = Σ_k w_k · expert_k(norm(h))   in every layer; no shared expert
    out = h + y

  - routing (`route`): the router's logits carry a bias; top-k on the logits, then a softmax over
    those k only (not over all experts);
  - experts: biased projections and a clamped SwiGLU, (min(u, ±7) + 1) · g·σ(1.702·g) with g ≤ 7
    (engine/kernels/experts_torch.py ClampedSwiGLU), run by the expert executor.

The checkpoints store the experts transposed, (E, H, 2I) with gate and up *interleaved* (gate in the
even columns) and (E, I, H); they are re-laid into the engine's gate-first (E, 2I, H) / (E, H, I) at
load. The KV must honour sinks and per-layer windows: resident KV does; under a hybrid policy the
window layers' KV stays resident and the full layers' spills (engine/kv/layer_split.py). The routed
experts' biases and activation reach every expert executor (`set_form`): resident and cached experts
run them in the grouped GEMM, the CPU set in the native CPU kernel (torch without the extension); the
matrix-vector decode kernels know plain SwiGLU only.
MXFP4 expert tensors of a safetensors folder are refused here. In a GGUF they stay MXFP4 blocks when
every expert runs on the CPU (dtype auto, resident policy: engine/quant/experts.py computes them with
their biases and clamped activation); any other placement dequantises them at load.
"""

from __future__ import annotations

import torch

from engine.errors import UnsupportedModelError
from engine.models.common import ModelArgs
from engine.models.gguf_names import moe_config_from_gguf, sanitize_moe_gguf
from engine.models.hf_config import decoder_args

NAME = "gpt_oss"
GGUF_ARCHS = {"gpt-oss"}
MODEL_TYPES = {"gpt_oss"}


def _windows(config: dict, n_layers: int) -> list[int | None]:
    window = int(config.get("sliding_window") or 0) or None
    types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(n_layers)]
    return [window if t == "sliding_attention" else None for t in types[:n_layers]]


def args_from_config(config: dict) -> ModelArgs:
    base = decoder_args(config, arch=NAME, default_theta=150000.0, default_max_position=131072)
    n_layers = base["n_layers"]
    windows = _windows(config, n_layers)
    expert_ffn = int(config["intermediate_size"])
    return ModelArgs(
        **base,
        head_dim=config.get("head_dim") or base["dim"] // base["n_heads"],
        ffn_dim=0,  # no dense FFN: every layer routes
        qkv_bias=bool(config.get("attention_bias", True)),
        o_bias=bool(config.get("attention_bias", True)),
        sliding_window=max((w for w in windows if w), default=None),  # loading checks the KV honours it
        layer_windows=windows,
        attn_sinks=True,
        n_experts=int(config.get("num_local_experts") or config.get("num_experts") or 0),
        top_k=int(config.get("num_experts_per_tok") or config.get("experts_per_token") or 4),
        expert_ffn_dim=expert_ffn,
        router_bias=True,
        expert_bias=True,
        expert_act="clamped",
        expert_alpha=float(config.get("swiglu_alpha", 1.702)),
        expert_limit=float(config.get("swiglu_limit", 7.0)),
    )


def route(logits: torch.Tensor, k: int, renormalise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, E), the router bias included → top-k on the logits, softmax over those k (in the
    logits' dtype, as the reference) → weights (N, k), ids (N, k)."""
    top, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(top, dim=-1), ids


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """(…, 2I) with gate in even and up in odd positions → (…, 2I) gate half first."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def sanitize_hf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """HF names → the engine's: router `mlp.router` → `mlp.gate`; experts re-laid gate-first and
    (out, in); their biases as the MoE layer's own parameters."""
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if "rotary_emb.inv_freq" in name:
            continue
        if name.endswith(("_blocks", "_scales")):
            raise UnsupportedModelError(f"tensor {name} is MXFP4-quantised in safetensors form",
                                        "use a BF16 checkpoint folder, or a GGUF of the model")
        layer = name.split("mlp.experts.")[0]  # "model.layers.{i}." for expert tensors
        # the checkpoints multiply x @ W: (E, H, 2I) and (E, I, H), whatever H and I are (the published
        # models have H = I, so the shapes cannot tell)
        if name.endswith("mlp.experts.gate_up_proj"):
            t = t.transpose(1, 2)  # (E, 2I, H), gate and up rows still interleaved
            out[name] = torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).contiguous()  # gate rows first
        elif name.endswith("mlp.experts.down_proj"):
            out[name] = t.transpose(1, 2).contiguous()  # (E, I, H) → (E, H, I)
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            out[layer + "mlp.expert_gate_up_bias"] = _deinterleave(t)
        elif name.endswith("mlp.experts.down_proj_bias"):
            out[layer + "mlp.expert_down_bias"] = t
        elif ".mlp.router." in name:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = t
        else:
            out[name] = t
    return out


def config_from_gguf(meta: dict) -> dict:
    a = meta["general.architecture"]

    def get(key, default=None):
        return meta.get(f"{a}.{key}", default)

    config = moe_config_from_gguf(meta, NAME)
    config["num_local_experts"] = config.pop("num_experts")
    config["intermediate_size"] = config.pop("moe_intermediate_size") or config["intermediate_size"]
    config["attention_bias"] = True
    n_layers = config["num_hidden_layers"]
    # llama.cpp's gpt-oss graph: even layers slide over the window, odd layers see everything
    config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    config.pop("rope_scaling", None)
    theta = config.pop("rope_theta")
    if get("rope.scaling.type") == "yarn" or get("rope.scaling.factor"):
        config["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": theta, "factor": float(get("rope.scaling.factor", 32.0)),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length", 4096)),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,  # gpt-oss's YaRN keeps the fractional correction range
        }
    else:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    config["swiglu_alpha"] = 1.702
    config["swiglu_limit"] = float(get("expert_swiglu_limit", 7.0) or 7.0)
    return config


# llama.cpp names of the tensors only this family has → HF-style names of the engine
_GGUF_EXTRA = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.bias": "mlp.gate.bias",
    "ffn_down_exps.bias": "mlp.expert_down_bias",
}


def sanitize_gguf(raw: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    main, extra, gate_up_bias = {}, {}, {}
    for name, t in raw.items():
        parts = name.split(".", 2)
        if parts[0] == "blk" and parts[2] in _GGUF_EXTRA:
            extra[f"model.layers.{parts[1]}.{_GGUF_EXTRA[parts[2]]}"] = t
        elif parts[0] == "blk" and parts[2] in ("ffn_gate_exps.bias", "ffn_up_exps.bias"):
            gate_up_bias.setdefault(int(parts[1]), {})["gate" if parts[2].startswith("ffn_gate") else "up"] = t
        else:
            main[name] = t
    out = sanitize_moe_gguf(main, config)
    out.update(extra)
    for layer, b in gate_up_bias.items():
        out[f"model.layers.{layer}.mlp.expert_gate_up_bias"] = torch.cat((b["gate"], b["up"]), dim=-1)  # (E, 2I)
    config["num_local_experts"] = config.pop("num_experts", None) or config["num_local_experts"]
    config["intermediate_size"] = config.pop("moe_intermediate_size", None) or config["intermediate_size"]
    config.pop("mlp_only_layers", None)
    return out
