"""Scaled RoPE variants read through transformers' own frequency functions (llama3 on llama)."""

from transformers import LlamaConfig, LlamaForCausalLM

from moe_helpers import assert_parity, build_hf, tiny_engine


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    ref = build_hf(LlamaConfig, LlamaForCausalLM, vocab_size=96, hidden_size=32, intermediate_size=48,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   initializer_range=0.2, bos_token_id=None, eos_token_id=None,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64})
    ref.save_pretrained(tmp_path / "m")
    engine = tiny_engine(tmp_path / "m")
    assert engine.parts.args.rope_inv_freq is not None
    assert_parity(engine, ref)
