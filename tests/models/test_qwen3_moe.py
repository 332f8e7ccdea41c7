"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM on tiny random configs (fp32, CPU)."""

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from moe_helpers import assert_parity, build_hf, tiny_engine, write_layout


def tiny(**overrides):
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
               rope_theta=10000.0, initializer_range=0.2, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.update(overrides)
    return build_hf(Qwen3MoeConfig, Qwen3MoeForCausalLM, **cfg)


def test_saved_folder_matches_transformers(tmp_path):
    """A folder written by save_pretrained, read back by both sides."""
    tiny().save_pretrained(tmp_path / "m")
    ref = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32,
                                              attn_implementation="eager").eval()
    engine = tiny_engine(tmp_path / "m")
    assert engine.info()["family"] == "qwen3_moe" and engine.info()["experts"] == 8
    assert_parity(engine, ref)


def test_fused_names_dense_layers_and_no_renormalisation(tmp_path):
    """transformers-5 fused expert names; layer 1 dense (mlp_only_layers); norm_topk_prob off."""
    ref = tiny(mlp_only_layers=[1], norm_topk_prob=False, seed=1)
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "fused"))
    layers = engine.parts.model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["MoEFeedForward", "FeedForward", "MoEFeedForward"]
    assert [layers[i].mlp.expert_layer for i in (0, 2)] == [0, 1]  # executor lists hold MoE layers only
    assert len(engine.parts.experts.gate_up) == 2
    assert_parity(engine, ref)


def test_per_expert_names_and_sparse_step(tmp_path):
    ref = tiny(decoder_sparse_step=2, num_hidden_layers=4, seed=2)  # layers 1 and 3 are MoE
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "per_expert"))
    assert engine.parts.args.moe_layer_ids() == [1, 3]
    assert_parity(engine, ref)


def test_sliding_window_shorter_than_the_prompt(tmp_path):
    """A 5-token window: prefill and decode both mask keys older than the window."""
    ref = tiny(use_sliding_window=True, sliding_window=5, seed=3)
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "fused"))
    assert engine.parts.kv.window == 5
    assert_parity(engine, ref)


def test_window_makes_a_difference(tmp_path):
    """Guard for the window test: the same weights without the window give other logits."""
    from moe_helpers import PROMPT, engine_logits

    ref = tiny(use_sliding_window=True, sliding_window=5, seed=3)
    folder = write_layout(ref, tmp_path / "m", "fused")
    windowed = engine_logits(tiny_engine(folder), PROMPT)
    cfg = (folder / "config.json").read_text().replace('"use_sliding_window": true', '"use_sliding_window": false')
    (folder / "config.json").write_text(cfg)
    full = engine_logits(tiny_engine(folder), PROMPT)
    assert torch.allclose(windowed[:5], full[:5], atol=1e-5)  # inside the window: identical
    assert (windowed[5:] - full[5:]).abs().max() > 1e-2


def test_yarn_rope_scaling(tmp_path):
    ref = tiny(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "original_max_position_embeddings": 64}, seed=4)
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "fused"))
    assert engine.parts.args.rope_inv_freq is not None and engine.parts.args.rope_attention_factor > 1.0
    assert_parity(engine, ref)


def test_dynamic_rope_is_refused(tmp_path):
    from engine.errors import UnsupportedModelError

    ref = tiny(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    folder = write_layout(ref, tmp_path / "m", "fused")
    with pytest.raises(UnsupportedModelError, match="RoPE scaling 'dynamic'"):
        tiny_engine(folder)


def test_gguf_round_trip(tmp_path):
    """The same weights written as a llama.cpp qwen3moe GGUF load to the same model."""
    from gguf_writers import write_moe_gguf
    from moe_helpers import PROMPT

    ref = tiny(seed=5)
    path = write_moe_gguf(ref, tmp_path / "m.gguf", arch="qwen3moe")
    engine = tiny_engine(path)
    assert engine.info()["family"] == "qwen3_moe"
    assert_parity(engine, ref)
    assert engine.generate_ids(PROMPT, 8) == tiny_engine(write_layout(ref, tmp_path / "f", "fused")).generate_ids(PROMPT, 8)
