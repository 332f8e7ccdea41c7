"""OLMoE against transformers' OlmoeForCausalLM on tiny random configs (fp32, CPU)."""

import torch
from transformers import OlmoeConfig, OlmoeForCausalLM

from moe_helpers import PROMPT, assert_parity, build_hf, engine_logits, tiny_engine, write_layout


def tiny(**overrides):
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
               norm_topk_prob=False, max_position_embeddings=256, rope_theta=10000.0, initializer_range=0.2,
               tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.update(overrides)
    return build_hf(OlmoeConfig, OlmoeForCausalLM, **cfg)


def test_saved_folder_matches_transformers(tmp_path):
    tiny().save_pretrained(tmp_path / "m")
    ref = OlmoeForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32, attn_implementation="eager").eval()
    engine = tiny_engine(tmp_path / "m")
    attn = engine.parts.model.model.layers[0].self_attn
    assert engine.info()["family"] == "olmoe"
    assert attn.q_norm.weight.shape == (32,) and attn.k_norm.weight.shape == (16,)  # whole projections
    assert_parity(engine, ref)


def test_qk_norm_spans_all_heads(tmp_path):
    """Per-head norms (Qwen3's) on OLMoE weights would give other logits: the scope matters."""
    ref = tiny(seed=1)
    for layer in ref.model.layers:  # non-trivial norm weights make the two scopes differ more
        layer.self_attn.q_norm.weight.data.uniform_(0.5, 1.5)
        layer.self_attn.k_norm.weight.data.uniform_(0.5, 1.5)
    folder = write_layout(ref, tmp_path / "m", "fused")
    engine = tiny_engine(folder)
    assert_parity(engine, ref)
    right = engine_logits(engine, PROMPT)
    for layer in engine.parts.model.model.layers:
        layer.self_attn.norm_all_heads = False
        layer.self_attn.q_norm.weight = torch.nn.Parameter(layer.self_attn.q_norm.weight[:8])
        layer.self_attn.k_norm.weight = torch.nn.Parameter(layer.self_attn.k_norm.weight[:8])
    assert (engine_logits(engine, PROMPT) - right).abs().max() > 1e-2


def test_clip_qkv_bias_and_renormalisation(tmp_path):
    ref = tiny(clip_qkv=0.5, attention_bias=True, norm_topk_prob=True, seed=2)
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "per_expert"))
    assert engine.parts.args.clip_qkv == 0.5 and engine.parts.model.model.layers[0].self_attn.o_proj.bias is not None
    assert_parity(engine, ref)


def test_gguf_round_trip(tmp_path):
    from gguf_writers import write_moe_gguf

    ref = tiny(seed=3)
    engine = tiny_engine(write_moe_gguf(ref, tmp_path / "m.gguf", arch="olmoe"))
    assert engine.info()["family"] == "olmoe" and engine.parts.args.norm_topk_prob is False
    assert_parity(engine, ref)
