"""DeepSeek-V2 from GGUF files as llama.cpp's converter writes arch `deepseek2`, against transformers'
DeepseekV2ForCausalLM on the same tiny random weights (fp32, CPU; tolerances as test_deepseek_v2.py):
kv_b whole or split into attn_k_b / attn_v_b, with and without a q LoRA, YaRN, Q8_0 blocks kept.
"""

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV2ForCausalLM"):
    pytest.skip("this transformers has no deepseek_v2", allow_module_level=True)
pytest.importorskip("gguf")

from gguf_writers import finish  # noqa: E402
from moe_helpers import PROMPT, assert_parity, tiny_engine  # noqa: E402
from test_deepseek_v2 import YARN, tiny  # noqa: E402

_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
    "mlp.gate": "ffn_gate_inp", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def write_deepseek2_gguf(model, path, split_kv_b: bool = True, q8: bool = False):
    """Names and metadata of llama.cpp's deepseek2 (MQA over latent rows: head_count_kv 1, key_length
    r + dr, the per-head widths as *_mla). split_kv_b: kv_b_proj as attn_k_b (nh, r, dn) and attn_v_b
    (nh, dv, r), as current converters write it; else whole, as older ones did. q8: every 2-D matrix
    whose rows are whole Q8_0 blocks (32 values) stored as Q8_0."""
    import gguf
    from gguf.quants import quantize

    c = model.config
    nh, dn, dr, dv, r = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                         c.kv_lora_rank)
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(nh)
    w.add_head_count_kv(1)
    w.add_key_length(r + dr)
    w.add_value_length(r)
    w.add_key_length_mla(dn + dr)
    w.add_value_length_mla(dv)
    w.add_kv_lora_rank(r)
    if c.q_lora_rank:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_rope_dimension_count(dr)
    rope = c.rope_parameters
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    add = w.add_tensor
    if q8:
        def add(name, t):
            if t.ndim == 2 and t.shape[1] % 32 == 0:
                q8_0 = gguf.GGMLQuantizationType.Q8_0
                w.add_tensor(name, quantize(t, q8_0), raw_dtype=q8_0)
            else:
                w.add_tensor(name, t)
    add("token_embd.weight", sd.pop("model.embed_tokens.weight"))
    add("output_norm.weight", sd.pop("model.norm.weight"))
    add("output.weight", sd.pop("lm_head.weight"))
    for name, t in sd.items():
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            for kind, part in (("ffn_gate_exps", t[:, :inter]), ("ffn_up_exps", t[:, inter:]),
                               ("ffn_down_exps", sd[name.replace("gate_up_proj", "down_proj")])):
                part = np.ascontiguousarray(part)
                if q8 and part.shape[-1] % 32 == 0:  # the routed experts in blocks too
                    q8_0 = gguf.GGMLQuantizationType.Q8_0
                    w.add_tensor(f"blk.{layer}.{kind}.weight", quantize(part, q8_0), raw_dtype=q8_0)
                else:
                    w.add_tensor(f"blk.{layer}.{kind}.weight", part)
        elif rest == "mlp.experts.down_proj":
            continue
        elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
            kv_b = t.reshape(nh, dn + dv, r)
            w.add_tensor(f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :dn].transpose(0, 2, 1)))
            w.add_tensor(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, dn:]))
        elif rest == "self_attn.kv_b_proj.weight":
            add(f"blk.{layer}.attn_kv_b.weight", np.ascontiguousarray(t))
        else:
            module, suffix = rest.rsplit(".", 1)
            add(f"blk.{layer}.{_NAMES[module]}.{suffix}", np.ascontiguousarray(t))
    return finish(w, path)


def test_gguf_round_trip(tmp_path):
    """V2-Lite's form with YaRN, kv_b split into attn_k_b / attn_v_b."""
    ref = tiny(seed=6, rope_parameters=dict(YARN))
    engine = tiny_engine(write_deepseek2_gguf(ref, tmp_path / "m.gguf"))
    args = engine.parts.args
    assert engine.info()["family"] == "deepseek_v2" and args.mla.q_lora_rank is None
    assert (args.mla.qk_nope_head_dim, args.mla.v_head_dim, args.mla.kv_lora_rank) == (8, 6, 16)
    assert_parity(engine, ref)


def test_gguf_whole_kv_b_and_q_lora(tmp_path):
    ref = tiny(seed=7, q_lora_rank=12, routed_scaling_factor=1.5)
    engine = tiny_engine(write_deepseek2_gguf(ref, tmp_path / "m.gguf", split_kv_b=False))
    assert engine.parts.args.mla.q_lora_rank == 12 and engine.parts.args.routed_scaling == 1.5
    assert_parity(engine, ref)


def test_q8_0_gguf_kept_in_blocks_follows_the_dequantised_one(tmp_path):
    """dtype auto on the CPU keeps a GGUF's Q8_0 matrices and routed experts in blocks (engine/quant); the projections
    whose RoPE rows are re-laid (q, kv_a) and kv_b, which MLA absorbs, are dequantised at load. The
    same tokens as the file dequantised whole."""
    from engine.api import Engine, EngineConfig
    from engine.quant.modules import QuantLinear

    from engine.quant.blocks import QuantStack

    ref = tiny(seed=9, q_lora_rank=32, hidden_size=64, n_routed_experts=8, moe_intermediate_size=32)
    path = write_deepseek2_gguf(ref, tmp_path / "q.gguf", split_kv_b=False, q8=True)
    quant = Engine(EngineConfig(model=str(path), backend="tandem", device="cpu", max_batch=1))
    plain = tiny_engine(path)
    assert isinstance(quant.parts.experts.gate_up[0], QuantStack)  # the routed experts in their blocks
    attn = quant.parts.model.model.layers[1].self_attn
    assert isinstance(attn.q_a_proj, QuantLinear) and not isinstance(attn.q_b_proj, QuantLinear)
    assert not isinstance(attn.kv_a_proj_with_mqa, QuantLinear) and not isinstance(attn.kv_b_proj, QuantLinear)
    assert quant.generate_ids(PROMPT, 12) == plain.generate_ids(PROMPT, 12)


def test_gguf_header_gives_the_shape(tmp_path):
    """models/shape.py reads the header only (what the planner sizes)."""
    from engine.models.shape import model_args

    args = model_args(str(write_deepseek2_gguf(tiny(seed=8, q_lora_rank=12), tmp_path / "m.gguf")))
    assert args.arch == "deepseek_v2" and args.moe_layer_ids() == [1, 2] and args.mla.q_lora_rank == 12
    assert (args.n_kv_heads, args.head_dim) == (1, 20)
