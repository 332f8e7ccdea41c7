"""Synthetic models: the published shapes of real MoE models with seeded random weights.

`synthetic:<preset>` builds the model of a real checkpoint's config.json (values copied from the
published file, cited per preset) with random weights, so that every benchmark runs on machines
that hold no checkpoint. `synthetic:<preset>-L<n>` keeps only the first n layers' shape (e.g.
`synthetic:qwen3-30b-a3b-L12`). `config_for(name, vocab_size=…)` / `load(…, vocab_size=…)` resize the
vocabulary (only the embedding and head change shape): the GGUF export sizes it to its borrowed tokenizer.
A last `-Q4_0` or `-Q8_0` (`synthetic:qwen3-30b-a3b-Q4_0`) quantises the routed experts as they are
generated and keeps them in blocks, as a GGUF file of that type loads.

Weights are generated straight into their final placement: each tensor is allocated on the target
device and filled there by torch's RNG (one kernel per tensor, no host copy, no per-element Python),
in bf16 unless asked otherwise. The 61 GB Qwen3-30B-A3B is a few hundred such calls. Routed experts
come stacked per layer in the fused (E, 2I, H)/(E, H, I) layout the expert executors take.

Scale: every matrix is N(0, 1/fan_in) and every norm weight 1, so each sublayer maps unit-RMS
inputs to O(1) outputs, the residual stream grows only like √layers, and logits and router logits
are O(1): activations stay finite in bf16 over long decodes.

What these models are not: they have no tokenizer (token ids in and out: `Engine.generate_ids`) and
no EOS (generation always runs to max_new_tokens). Their routers are random projections, which spread
tokens near-uniformly over the experts — the worst case for an expert cache, not what trained
routers do; benchmarks must report it as such. The numbers drawn depend on the device (CPU and CUDA
generators differ) but are fixed for a given device, seed and preset.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from engine.errors import ConfigError
from engine.models import families
from engine.models.assemble import tensor_shapes
from engine.models.loader import Checkpoint
from engine.quant.blocks import QuantStack
from engine.quant.quantise import CODES, quantise

DEFAULT_SEED = 0

PRESETS: dict[str, dict] = {
    # Qwen/Qwen3-30B-A3B config.json: 48 layers, 128 experts (top 8) of 768, 30.5 B parameters.
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # meta-llama/Llama-3.2-1B config.json, a dense model: 16 layers, FFN 8192, 1.24 B parameters. Its
    # llama3 RoPE scaling is left out (plain RoPE at θ = 500000): a GGUF export writes no scaled RoPE, and
    # random weights have no trained long context to keep.
    "llama-3.2-1b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # mistralai/Mixtral-8x7B-v0.1 config.json: 32 layers, 8 experts (top 2) of 14336, 46.7 B parameters.
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # allenai/OLMoE-1B-7B-0924 config.json: 16 layers, 64 experts (top 8) of 1024, 6.9 B parameters.
    "olmoe-1b-7b": {
        "model_type": "olmoe",
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "clip_qkv": None,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "tie_word_embeddings": False,
        "pad_token_id": 1,
        "bos_token_id": None,
        "eos_token_id": 50279,
    },
    # zai-org/GLM-4.5-Air config.json: 46 layers (the first dense), 128 experts (top 8) of 1408 plus one
    # shared, sigmoid routing with a correction bias, RoPE on half of each 128-wide head, q/k/v
    # biases, 106 B parameters (its multi-token-prediction layer is not part of decoding).
    "glm-4.5-air": {
        "model_type": "glm4_moe",
        "vocab_size": 151552,
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": False,
        "first_k_dense_replace": 1,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "pad_token_id": 151329,
        "bos_token_id": None,
        "eos_token_id": [151329, 151336, 151338],
    },
    # openai/gpt-oss-20b config.json: 24 layers alternating a 128-token window with full attention
    # (even layers slide), attention sinks, 32 experts (top 4) of 2880 with biases and a clamped
    # SwiGLU, YaRN ×32 over 4096 positions, 21 B parameters (BF16 here; the release is MXFP4).
    "gpt-oss-20b": {
        "model_type": "gpt_oss",
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        "sliding_window": 128,
        "attention_bias": True,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "pad_token_id": 199999,
        "bos_token_id": None,
        "eos_token_id": 200002,
    },
    # deepseek-ai/DeepSeek-V2-Lite config.json: 27 layers (the first dense), multi-head latent attention
    # (no q LoRA, latent 512 + RoPE 64 cached per token), 64 experts (top 6) of 1408 plus 2 shared,
    # YaRN ×40 over 4096 positions, 15.7 B parameters.
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "attention_bias": False,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "tie_word_embeddings": False,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
    },

    # Qwen/Qwen3.5-35B-A3B config.json (text_config): 40 layers, every fourth full attention (16 heads, 2 KV
    # heads of 256, output gate, RoPE on 64 dims) and the others Gated DeltaNet (16 key heads, 32 value
    # heads of 128, a 4-tap convolution); 256 experts (top 8) of 512 plus a gated shared expert of 512;
    # 262,144 positions; 35 B parameters. The text model only: the release's vision tower is not run.
    "qwen3.5-35b-a3b": {
        "model_type": "qwen3_5_moe",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "attention_bias": False,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "tie_word_embeddings": False,
        "bos_token_id": None,
    },
}

_NAME = re.compile(r"synthetic:(?P<preset>[a-z0-9.-]+?)(?:-L(?P<layers>\d+))?(?:-(?P<quant>Q8_0|Q4_0))?")


def names() -> list[str]:
    return [f"synthetic:{k}" for k in PRESETS]


def parse(name: str) -> tuple[str, int | None]:
    """'synthetic:<preset>[-L<n>]' → (preset, n or None)."""
    m = _NAME.fullmatch(name)
    if m is None or m["preset"] not in PRESETS:
        raise ConfigError(f"unknown synthetic model '{name}'",
                          f"choose one of: {', '.join(names())}, each optionally with -L<layers>, then -Q4_0 "
                          "or -Q8_0 for its routed experts in blocks")
    layers = int(m["layers"]) if m["layers"] else None
    full = PRESETS[m["preset"]]["num_hidden_layers"]
    if layers is not None and not 1 <= layers <= full:
        raise ConfigError(f"'{name}' asks for {layers} layers; {m['preset']} has 1 to {full}",
                          f"use -L1 … -L{full}, or no suffix for all {full}")
    return m["preset"], layers


def expert_quant(name: str) -> str | None:
    """The block type of the routed experts a name asks for ('…-Q4_0', '…-Q8_0'), None for BF16: the
    random experts quantised as generated (engine/quant/quantise.py), what a host too small for a
    preset's BF16 experts holds (a 48-layer Qwen3-30B-A3B's 57 GB are 16 GB as Q4_0)."""
    parse(name)  # a name it refuses says why
    return _NAME.fullmatch(name)["quant"]


def config_for(name: str, vocab_size: int | None = None) -> dict:
    """The preset's config.json, cut to its first n layers, without an EOS token.

    `vocab_size` replaces the published vocabulary size (embedding and head rows): what an export
    for llama.cpp needs, whose files must carry a tokenizer of exactly that many tokens.
    """
    preset, layers = parse(name)
    config = dict(PRESETS[preset])
    if vocab_size is not None:
        if vocab_size < 1:
            raise ConfigError(f"vocabulary size {vocab_size} for '{name}' is not positive", "pass a size ≥ 1")
        config["vocab_size"] = int(vocab_size)
    if layers is not None:
        config["num_hidden_layers"] = layers
        if config.get("mlp_only_layers"):
            config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < layers]
    config["eos_token_id"] = None  # random weights: no token means "stop"
    return config


def init_std(name: str, shape: tuple) -> float | None:
    """Standard deviation of a weight's normal init; None: a norm weight (ones) or a bias (zeros)."""
    if len(shape) == 1:
        return None
    if name.endswith("embed_tokens.weight"):
        return 1.0  # unit-RMS token vectors; the first norm sees them as they are
    return shape[-1] ** -0.5  # fan_in is the last dim of (out, in) and of (E, out, in)


def load(name: str, *, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = DEFAULT_SEED,
         expert_device: torch.device | None = None, vocab_size: int | None = None) -> Checkpoint:
    """A Checkpoint whose tensors already lie where the model will use them.

    `expert_device` places the routed experts elsewhere (the host store of an offloading executor);
    default: with the rest on `device`. `vocab_size`: see config_for.
    """
    config = config_for(name, vocab_size)
    family = families.for_model_type(config["model_type"], Path(name))
    tensors = dict(generate(name, config, device=device, dtype=dtype, seed=seed, expert_device=expert_device))
    return Checkpoint(Path(name), family.NAME, config, tensors)


def generate(name: str, config: dict, *, device: torch.device, dtype: torch.dtype = torch.bfloat16,
             seed: int = DEFAULT_SEED, expert_device: torch.device | None = None):
    """Yield (HF name, tensor) of `config`'s model one tensor at a time, in `tensor_shapes` order:
    the same numbers `load` gives, for writers that stream them to disk without holding them all."""
    family = families.for_model_type(config["model_type"], Path(name))
    args = family.args_from_config(config)
    quant = expert_quant(name)
    generators: dict[str, torch.Generator] = {}
    for tensor_name, shape in tensor_shapes(args).items():  # a fixed order: same seed, same weights
        where = expert_device if expert_device is not None and ".mlp.experts." in tensor_name else device
        key = str(where)
        if key not in generators:
            generators[key] = torch.Generator(device=where).manual_seed(seed)
        t = torch.empty(shape, device=where, dtype=dtype)
        std = init_std(tensor_name, shape)
        if std is not None:
            t.normal_(0.0, std, generator=generators[key])
        elif tensor_name.endswith(("bias", "sinks")):  # biases, GLM's correction bias, gpt-oss's sinks: zero
            t.zero_()
        else:
            t.fill_(1.0)
        if quant is not None and ".mlp.experts." in tensor_name and len(shape) == 3:
            t = _quantised_stack(t, quant, tensor_name, config["hidden_size"])
        yield tensor_name, t


def _quantised_stack(t: torch.Tensor, quant: str, name: str, hidden: int) -> QuantStack:
    """A routed experts' stack (E, N, K) quantised along K, as a GGUF file's `*_exps` loads: a QuantStack
    over host bytes. The engine's layout only: gate_up (E, 2I, H) and down (E, H, I)."""
    E, N, K = t.shape
    gate_up_ok = name.endswith("gate_up_proj") and K == hidden  # (E, 2I, H)
    down_ok = name.endswith("down_proj") and N == hidden  # (E, H, I)
    if not (gate_up_ok or down_ok):
        raise ConfigError(f"{name} of shape {tuple(t.shape)} is not laid out (experts, out, in)",
                          f"drop -{quant}: this preset's experts are generated in BF16 only")
    blocks = quantise(t, quant).cpu().numpy()  # (E, N, K/32 · block bytes) uint8
    return QuantStack.from_gguf(blocks, CODES[quant], name)
