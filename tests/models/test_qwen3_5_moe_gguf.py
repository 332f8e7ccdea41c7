"""Qwen3.5-MoE from GGUF files written as llama.cpp's converter writes arch `qwen35moe` (its
conversion/qwen.py: Qwen3_5MoeTextModel and the classes it builds on), F32, against transformers.

What the writer does to the checkpoint's tensors, as the converter does: (1 + w) norms stored as
1 + w (not the DeltaNet's), A_log as −exp(A_log), dt_bias as ssm_dt.bias, the convolution squeezed
to (C, K), value heads reordered from grouped by key head to tiled, the shared expert's gate as a
vector, the prediction block appended past num_hidden_layers.
Tolerance: moe_helpers.FP32_ATOL (the same weights through another file format), greedy tokens equal.
"""

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
    pytest.skip("this transformers has no qwen3_5_moe", allow_module_level=True)

from gguf_writers import add_prediction_block, finish  # noqa: E402
from moe_helpers import assert_parity, tiny_engine  # noqa: E402
from test_qwen3_5_moe import tiny  # noqa: E402

_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
}
_CENTRED = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")


def _tiled(t: np.ndarray, axis: int, n_k: int, n_v: int, head: int) -> np.ndarray:
    """The converter's value-head order: grouped (n_k, n_v/n_k, head) → tiled (n_v/n_k, n_k, head)."""
    shape = list(t.shape)
    t = t.reshape(shape[:axis] + [n_k, n_v // n_k, head] + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(t, axis, axis + 1).reshape(shape))


def write_qwen35_gguf(model, path, nextn: bool = True, fused_experts: bool = False, recurrent_key: bool = False,
                      q8_experts: bool = False):
    """q8_experts: the routed experts in Q8_0 blocks (gguf's quantiser), the rest F32."""
    import gguf
    from gguf.quants import quantize

    c = model.config
    L, arch = c.num_hidden_layers, "qwen35moe"
    n_k, n_v, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L + (1 if nextn else 0))
    if nextn:
        w.add_nextn_predict_layers(1)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(n_k)
    w.add_ssm_time_step_rank(n_v)
    w.add_ssm_inner_size(n_v * dv)
    if recurrent_key:
        w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in c.layer_types] +
                    [False] * (1 if nextn else 0))
    else:
        w.add_full_attention_interval(4)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd.pop("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", sd.pop("model.norm.weight") + 1)
    w.add_tensor("output.weight", sd.pop("lm_head.weight"))
    qk = 2 * n_k * dk
    for name, t in sd.items():
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            down = sd[name.replace("gate_up_proj", "down_proj")]
            parts = [("ffn_gate_up_exps", t)] if fused_experts else [("ffn_gate_exps", t[:, :inter]),
                                                                    ("ffn_up_exps", t[:, inter:])]
            for kind, part in parts + [("ffn_down_exps", down)]:
                if q8_experts:
                    q8 = gguf.GGMLQuantizationType.Q8_0
                    w.add_tensor(f"{blk}{kind}.weight", quantize(np.ascontiguousarray(part), q8), raw_dtype=q8)
                else:
                    w.add_tensor(f"{blk}{kind}.weight", np.ascontiguousarray(part))
            continue
        if rest == "mlp.experts.down_proj":
            continue
        if rest == "linear_attn.A_log":
            w.add_tensor(blk + "ssm_a", _tiled(-np.exp(t), 0, n_k, n_v, 1))
            continue
        if rest == "linear_attn.dt_bias":
            w.add_tensor(blk + "ssm_dt.bias", _tiled(t, 0, n_k, n_v, 1))
            continue
        if rest == "linear_attn.conv1d.weight":
            t = t.squeeze(1)  # (C, K)
            w.add_tensor(blk + "ssm_conv1d.weight", np.concatenate((t[:qk], _tiled(t[qk:], 0, n_k, n_v, dv))))
            continue
        module, suffix = rest.rsplit(".", 1)
        if module in _CENTRED:
            t = t + 1
        elif module == "linear_attn.in_proj_qkv":
            t = np.concatenate((t[:qk], _tiled(t[qk:], 0, n_k, n_v, dv)))
        elif module == "linear_attn.in_proj_z":
            t = _tiled(t, 0, n_k, n_v, dv)
        elif module in ("linear_attn.in_proj_a", "linear_attn.in_proj_b"):
            t = _tiled(t, 0, n_k, n_v, 1)
        elif module == "linear_attn.out_proj":
            t = _tiled(t, 1, n_k, n_v, dv)
        elif module == "mlp.shared_expert_gate":
            w.add_tensor(blk + "ffn_gate_inp_shexp.weight", np.ascontiguousarray(t.reshape(-1)))
            continue
        w.add_tensor(f"{blk}{_NAMES[module]}.{suffix}", np.ascontiguousarray(t))
    if nextn:
        add_prediction_block(w, sd, L, c.hidden_size, _NAMES)
    return finish(w, path)


def test_gguf_matches_transformers(tmp_path):
    """Four value heads on two key heads (the reordering matters), the prediction block dropped."""
    ref = tiny(seed=8)
    engine = tiny_engine(write_qwen35_gguf(ref, tmp_path / "m.gguf"))
    args = engine.parts.args
    assert engine.info()["family"] == "qwen3_5_moe" and args.n_layers == 4 and args.kv_layer_ids() == [3]
    assert args.linear_attn.n_v_heads == 4 and args.rotary_dim == 4 and args.shared_expert_ffn_dim == 24
    assert_parity(engine, ref)


def test_gguf_fused_experts_and_recurrent_layer_list(tmp_path):
    """ffn_gate_up_exps (the converter's fused option) and the per-layer recurrent flags instead of
    the interval; full attention first, as the flags say."""
    types = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    ref = tiny(seed=9, layer_types=types)
    engine = tiny_engine(write_qwen35_gguf(ref, tmp_path / "m.gguf", nextn=False, fused_experts=True,
                                           recurrent_key=True))
    assert engine.parts.args.kv_layer_ids() == [0, 3]
    assert_parity(engine, ref)


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_q8_0_experts_stay_blocks_and_follow_the_file_dequantised(tmp_path, fused):
    """dtype auto keeps the routed experts in their Q8_0 blocks (split stacks, or the fused gate_up),
    resident on the CPU and in a simulated offload's store, and computes what the file dequantised to
    float32 does: int16-rounded activations through four layers, 1e-3 of the logits' scale."""
    from moe_helpers import engine_logits

    from engine.quant.blocks import QuantStack

    ref = tiny(seed=10, moe_intermediate_size=32)  # Q8_0 rows: whole 32-weight blocks
    path = write_qwen35_gguf(ref, tmp_path / "q8.gguf", nextn=False, fused_experts=fused, q8_experts=True)
    dense = tiny_engine(path)
    want = engine_logits(dense, [3, 17, 5, 42, 8, 9, 33, 60, 2, 71], prefill=6)
    scale = float(want.abs().max())
    for kw in ({}, {"expert_policy": "cpu-only", "simulate_hybrid": True, "kv_policy": "resident"}):
        engine = tiny_engine(path, dtype="auto", **kw)
        experts = engine.parts.experts
        held = experts.store.quantised if kw else isinstance(experts.gate_up[0], QuantStack)
        assert held, kw
        got = engine_logits(engine, [3, 17, 5, 42, 8, 9, 33, 60, 2, 71], prefill=6)
        assert scale > 0.1 and float((got - want).abs().max()) <= 1e-3 * scale, kw
