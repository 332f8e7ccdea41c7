"""Mixtral against transformers' MixtralForCausalLM on tiny random configs (fp32, CPU)."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from moe_helpers import PROMPT, assert_parity, build_hf, tiny_engine, write_layout


def tiny(**overrides):
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
               max_position_embeddings=256, rope_theta=1e6, initializer_range=0.2,
               tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.update(overrides)
    return build_hf(MixtralConfig, MixtralForCausalLM, **cfg)


def test_saved_folder_matches_transformers(tmp_path):
    tiny().save_pretrained(tmp_path / "m")
    ref = MixtralForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32, attn_implementation="eager").eval()
    engine = tiny_engine(tmp_path / "m")
    assert engine.info()["family"] == "mixtral" and engine.info()["top_k"] == 2
    assert_parity(engine, ref)


def test_block_sparse_moe_names(tmp_path):
    """Mixtral's own checkpoint names: block_sparse_moe.experts.{e}.w1/w3/w2 and block_sparse_moe.gate."""
    ref = tiny(seed=1)
    folder = write_layout(ref, tmp_path / "m", "mixtral")
    from safetensors import safe_open
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in f.keys()
    assert_parity(tiny_engine(folder), ref)


def test_fused_names(tmp_path):
    ref = tiny(seed=2)
    assert_parity(tiny_engine(write_layout(ref, tmp_path / "m", "fused")), ref)


def test_sliding_window(tmp_path):
    ref = tiny(sliding_window=4, seed=3)
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "mixtral"))
    assert engine.parts.kv.window == 4
    assert_parity(engine, ref)


def test_window_not_shorter_than_the_context_is_dropped(tmp_path):
    ref = tiny(sliding_window=4096, seed=3)
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "mixtral"))
    assert engine.parts.kv.window is None  # 4096 ≥ max_context 256: the window never bites


def test_gguf_as_llama_with_experts(tmp_path):
    """llama.cpp files Mixtral under `llama` with an expert count and permuted q/k; early files
    hold experts one by one (ffn_gate.{e}). Both load to the model transformers runs."""
    from gguf_writers import write_moe_gguf

    ref = tiny(seed=4)
    for per_expert in (False, True):
        path = write_moe_gguf(ref, tmp_path / f"m{per_expert}.gguf", arch="llama", per_expert=per_expert)
        engine = tiny_engine(path)
        assert engine.info()["family"] == "mixtral"
        assert_parity(engine, ref, PROMPT)
