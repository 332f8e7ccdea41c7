"""Qwen3.5-MoE against transformers' Qwen3_5MoeForCausalLM on tiny random configs (fp32, CPU).

The baby models have Gated DeltaNet layers (value heads twice the key heads, a 4-tap convolution)
and full-attention layers (output gate, partial RoPE on a quarter of each head, q/k norms), every
layer routed with a gated shared expert. transformers initialises the 1-D parameters (norm weights,
A_log, dt_bias) to constants; they are randomised so that each of them matters.
Tolerance: moe_helpers.FP32_ATOL (1e-4 absolute on O(1) logits: the chunked delta rule sums in
another order than the reference's; observed ≤ 2e-5), greedy tokens equal.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):  # transformers 5.17 predates the family
    pytest.skip("this transformers has no qwen3_5_moe", allow_module_level=True)
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402

from moe_helpers import FP32_ATOL, PROMPT, assert_parity, build_hf, engine_logits, hf_logits, tiny_engine, \
    write_layout  # noqa: E402


def tiny(seed: int = 0, **overrides):
    cfg = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_conv_kernel_dim=4, moe_intermediate_size=16,
               shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
               max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.update(overrides)
    model = build_hf(Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, seed=seed, **cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 100)
        for name, t in model.named_parameters():
            if t.dim() == 1:
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    return model


def test_saved_folder_matches_transformers(tmp_path):
    """save_pretrained's folder: layers 0-2 DeltaNet, layer 3 full attention; prefill, decode through
    the KV and the recurrent state, greedy generation."""
    tiny().save_pretrained(tmp_path / "m")
    ref = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32,
                                                attn_implementation="eager").eval()
    engine = tiny_engine(tmp_path / "m")
    info, args = engine.info(), engine.parts.args
    assert info["family"] == "qwen3_5_moe" and info["experts"] == 8
    assert args.kv_layer_ids() == [3] and args.rotary_dim == 4 and args.shared_expert_ffn_dim == 24
    layers = engine.parts.model.model.layers
    assert [layer.is_linear for layer in layers] == [True, True, True, False]
    assert engine.parts.kv.inner.k.shape[0] == 1  # KV for the one full-attention layer only
    assert_parity(engine, ref)


def test_long_prompt_crosses_delta_rule_chunks(tmp_path):
    """150 tokens: the chunked delta rule carries its state over 64-token chunks, and a prefill split
    100 + 50 (two engine steps) carries it over steps; 8 layers, two of them full attention."""
    ref = tiny(seed=1, num_hidden_layers=8)
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "per_expert"))
    prompt = [(7 * i + 3) % 96 for i in range(150)]
    theirs = hf_logits(ref, prompt)
    torch.testing.assert_close(engine_logits(engine, prompt), theirs, atol=FP32_ATOL, rtol=0)
    p, kv = engine.parts, engine.parts.kv
    sid = kv.new_sequence()
    rows = []
    for chunk in (prompt[:100], prompt[100:]):
        positions = kv.begin_step([sid], len(chunk))
        rows.append(p.model(torch.tensor([chunk]), positions, kv, last_only=False)[0])
        kv.end_step()
    kv.free(sid)
    torch.testing.assert_close(torch.cat(rows), theirs, atol=FP32_ATOL, rtol=0)


def test_custom_layer_types_and_equal_heads(tmp_path):
    """layer_types given explicitly (full attention first), as many value heads as key heads."""
    types = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    ref = tiny(seed=2, layer_types=types, linear_num_value_heads=2)
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "fused"))
    assert engine.parts.args.kv_layer_ids() == [0, 3]
    assert_parity(engine, ref)


def test_vision_language_release_layout(tmp_path):
    """The release's folder: text_config nested in config.json, the text model under
    model.language_model., a vision tower and a prediction head beside it (both dropped)."""
    from safetensors.torch import load_file, save_file

    ref = tiny(seed=3)
    folder = write_layout(ref, tmp_path / "m", "per_expert")
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    renamed["mtp.fc.weight"] = torch.zeros(32, 64)
    save_file(renamed, str(folder / "model.safetensors"))
    text = json.loads((folder / "config.json").read_text())
    outer = {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 2},
             "tie_word_embeddings": False, "image_token_id": 90}
    (folder / "config.json").write_text(json.dumps(outer))
    engine = tiny_engine(folder)
    assert engine.info()["family"] == "qwen3_5_moe"
    torch.testing.assert_close(engine_logits(engine, PROMPT), hf_logits(ref, PROMPT), atol=FP32_ATOL, rtol=0)
