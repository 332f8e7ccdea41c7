"""GLM-4.5 MoE against transformers' Glm4MoeForCausalLM on tiny random configs (fp32, CPU).

The baby models have a dense first layer (first_k_dense_replace) and MoE layers with a shared expert,
a sigmoid router whose correction bias is random (so it changes which experts are chosen), partial
RoPE and attention biases; variants add group-limited top-k, qk-norm, scaling and no renormalisation.
Tolerance: moe_helpers.FP32_ATOL (1e-4 absolute on O(1) logits), greedy tokens equal.
"""

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Glm4MoeForCausalLM"):
    pytest.skip("this transformers has no glm4_moe", allow_module_level=True)
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM  # noqa: E402

from gguf_writers import add_prediction_block, finish  # noqa: E402
from moe_helpers import PROMPT, assert_parity, build_hf, engine_logits, tiny_engine, write_layout  # noqa: E402


def tiny(seed: int = 0, **overrides):
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
               attention_bias=True, norm_topk_prob=True, max_position_embeddings=256,
               initializer_range=0.2, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.update(overrides)
    model = build_hf(Glm4MoeConfig, Glm4MoeForCausalLM, seed=seed, **cfg)
    with torch.no_grad():  # transformers initialises biases to zero: make them matter
        g = torch.Generator().manual_seed(seed + 100)
        for name, t in model.named_parameters():
            if name.endswith(".bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
        for name, t in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.2)
    return model


def test_saved_folder_matches_transformers(tmp_path):
    """A folder written by save_pretrained, read back by both sides: dense layer 0, MoE layers 1-2
    with a shared expert, sigmoid routing with a correction bias, partial RoPE, q/k/v biases."""
    tiny().save_pretrained(tmp_path / "m")
    ref = Glm4MoeForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32,
                                             attn_implementation="eager").eval()
    engine = tiny_engine(tmp_path / "m")
    info, args = engine.info(), engine.parts.args
    assert info["family"] == "glm4_moe" and info["experts"] == 8
    assert args.moe_layer_ids() == [1, 2] and args.rotary_dim == 8 and args.shared_expert_ffn_dim == 16
    layers = engine.parts.model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["FeedForward", "MoEFeedForward", "MoEFeedForward"]
    assert layers[1].mlp.shared_experts is not None
    assert_parity(engine, ref)


def test_correction_bias_changes_the_choice(tmp_path):
    """Guard: the correction bias really moves experts (a zero bias gives other logits)."""
    ref = tiny(seed=1)
    folder = write_layout(ref, tmp_path / "m", "fused")
    biased = engine_logits(tiny_engine(folder), PROMPT)
    with torch.no_grad():
        for name, t in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                t.zero_()
    plain = engine_logits(tiny_engine(write_layout(ref, tmp_path / "z", "fused")), PROMPT)
    assert (biased - plain).abs().max() > 1e-2


def test_groups_qk_norm_scaling_no_renormalisation(tmp_path):
    """Group-limited top-k (4 groups, best 2), per-head q/k norms, routed_scaling_factor 2.5,
    norm_topk_prob off, two dense layers, per-expert names."""
    ref = tiny(seed=2, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2, use_qk_norm=True,
               routed_scaling_factor=2.5, norm_topk_prob=False, first_k_dense_replace=2, num_hidden_layers=4)
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "per_expert"))
    args = engine.parts.args
    assert args.moe_layer_ids() == [2, 3] and args.router_groups == 4 and args.router_groups_used == 2
    assert args.qk_norm and args.routed_scaling == 2.5
    assert_parity(engine, ref)


def test_prediction_layer_of_the_checkpoint_is_dropped(tmp_path):
    """Published checkpoints hold a multi-token-prediction layer past num_hidden_layers."""
    from safetensors.torch import load_file, save_file

    ref = tiny(seed=3)
    folder = write_layout(ref, tmp_path / "m", "fused")
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [n for n in tensors if n.startswith("model.layers.2.")]:
        tensors[name.replace("model.layers.2.", "model.layers.3.")] = tensors[name].clone()
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(folder / "model.safetensors"))
    assert_parity(tiny_engine(folder), ref)


# -- GGUF, as llama.cpp's converter writes glm4moe ---------------------------------------------------

_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def write_glm_gguf(model, path, nextn: bool = True, q8_experts: bool = False):
    """Names and metadata of llama.cpp's glm4moe; `nextn` appends a prediction block (blk.L) as the
    converter does, counted in block_count; q8_experts: the routed experts in Q8_0 blocks."""
    import gguf
    from gguf.quants import quantize

    c = model.config
    L = c.num_hidden_layers
    w = gguf.GGUFWriter(str(path), "glm4moe")
    w.add_block_count(L + (1 if nextn else 0))
    w.add_nextn_predict_layers(1 if nextn else 0)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_expert_weights_norm(c.norm_topk_prob)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd.pop("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", sd.pop("model.norm.weight"))
    w.add_tensor("output.weight", sd.pop("lm_head.weight"))
    for name, t in sd.items():
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            for kind, part in (("ffn_gate_exps", t[:, :inter]), ("ffn_up_exps", t[:, inter:]),
                               ("ffn_down_exps", sd[name.replace("gate_up_proj", "down_proj")])):
                q8 = gguf.GGMLQuantizationType.Q8_0
                part = np.ascontiguousarray(part)
                w.add_tensor(f"blk.{layer}.{kind}.weight", *((quantize(part, q8),) if q8_experts else (part,)),
                             **({"raw_dtype": q8} if q8_experts else {}))
            continue
        if rest == "mlp.experts.down_proj":
            continue
        if rest == "mlp.gate.e_score_correction_bias":
            w.add_tensor(f"blk.{layer}.exp_probs_b.bias", np.ascontiguousarray(t))
            continue
        module, suffix = rest.rsplit(".", 1)
        w.add_tensor(f"blk.{layer}.{_NAMES[module]}.{suffix}", np.ascontiguousarray(t))
    if nextn:
        add_prediction_block(w, sd, L, c.hidden_size, _NAMES)
    return finish(w, path)


def test_gguf_round_trip(tmp_path):
    """The same weights as a llama.cpp glm4moe GGUF (with its prediction block) load to the same model."""
    ref = tiny(seed=4)
    engine = tiny_engine(write_glm_gguf(ref, tmp_path / "m.gguf"))
    assert engine.info()["family"] == "glm4_moe" and engine.parts.args.n_layers == 3
    assert engine.parts.args.qkv_bias and not engine.parts.args.qk_norm
    assert_parity(engine, ref)


def test_q8_0_experts_stay_blocks_and_follow_the_file_dequantised(tmp_path):
    """dtype auto keeps the routed experts in their Q8_0 blocks beside the dense first layer and the
    shared expert, and computes what the file dequantised to float32 does: int16-rounded activations,
    1e-3 of the logits' scale."""
    from engine.quant.blocks import QuantStack

    ref = tiny(seed=6, moe_intermediate_size=32)  # Q8_0 rows: whole 32-weight blocks
    path = write_glm_gguf(ref, tmp_path / "q8.gguf", nextn=False, q8_experts=True)
    want = engine_logits(tiny_engine(path), PROMPT, prefill=6)
    engine = tiny_engine(path, dtype="auto")
    assert isinstance(engine.parts.experts.gate_up[0], QuantStack)
    got = engine_logits(engine, PROMPT, prefill=6)
    scale = float(want.abs().max())
    assert scale > 0.1 and float((got - want).abs().max()) <= 1e-3 * scale


def test_gguf_groups_and_qk_norm(tmp_path):
    ref = tiny(seed=5, use_qk_norm=True, routed_scaling_factor=1.5, norm_topk_prob=False, attention_bias=False)
    engine = tiny_engine(write_glm_gguf(ref, tmp_path / "m.gguf", nextn=False))
    assert engine.parts.args.qk_norm and not engine.parts.args.qkv_bias
    assert_parity(engine, ref)


def test_config_json_of_the_published_shape_reads(tmp_path):
    """The preset's config (GLM-4.5-Air) gives the published layer plan."""
    from engine.models import synthetic
    from engine.models.glm4_moe import args_from_config

    args = args_from_config(json.loads(json.dumps(synthetic.config_for("synthetic:glm-4.5-air"))))
    assert args.n_layers == 46 and args.moe_layer_ids() == list(range(1, 46))
    assert (args.n_experts, args.top_k, args.expert_ffn_dim, args.shared_expert_ffn_dim) == (128, 8, 1408, 1408)
    assert (args.n_heads, args.n_kv_heads, args.head_dim, args.rotary_dim) == (96, 8, 128, 64)


# -- expert policies: the routed experts go through the executor, the shared expert stays dense -----

@pytest.mark.parametrize("policy", ["adaptive", "on-demand", "cpu-only"])
def test_offloaded_experts_generate_what_resident_generates(tmp_path, policy):
    """Simulated hybrid with a VRAM budget that holds a few of the 16 routed experts: the same
    tokens and logits as resident execution; the shared experts are dense weights on the device."""
    from engine.experts.offload import OffloadedExperts

    ref = tiny(seed=6, num_hidden_layers=3)
    folder = write_layout(ref, tmp_path / "m", "fused")
    resident = tiny_engine(folder)
    expected = resident.generate_ids(PROMPT, 12)
    # a budget of the dense weights (shared experts included), the resident KV and six of the 6 KiB
    # expert blocks, plus the tenth the cache sizing holds back
    slot, kv = 3 * 32 * 16 * 4, 2 * 3 * 128 * 2 * 16 * 4  # 3 layers × 64 tokens × max_batch 2, 2 KV heads
    budget = (resident.parts.weights_bytes + kv + 6 * slot) / 0.9 / 2**30
    offloaded = tiny_engine(folder, expert_policy=policy, simulate_hybrid=True, vram_budget_gb=budget,
                            kv_policy="resident", max_context=64)
    ex = offloaded.parts.experts
    assert isinstance(ex, OffloadedExperts) and ex.store.n_routed == 16
    if policy != "cpu-only":
        assert 0 < ex.cache.n_slots < 16
    shared = {n for n, _ in offloaded.parts.model.named_parameters() if ".shared_experts." in n}
    assert len(shared) == 2 * 3  # two MoE layers × gate/up/down, model parameters (not executor blocks)
    assert offloaded.generate_ids(PROMPT, 12) == expected
    torch.testing.assert_close(engine_logits(offloaded, PROMPT, prefill=4), engine_logits(resident, PROMPT, prefill=4),
                               atol=1e-5, rtol=0)
    t = ex.telemetry()
    assert t["misses"] > 0 and (t["cpu_executed"] > 0 or t["fills"] > 0)


# -- the synthetic preset ---------------------------------------------------------------------------

def test_preset_has_the_published_size():
    from engine.models import families, synthetic
    from engine.models.assemble import tensor_shapes

    def n_params(name):
        config = synthetic.config_for(name)
        args = families.for_model_type(config["model_type"], name).args_from_config(config)
        return sum(torch.Size(s).numel() for s in tensor_shapes(args).values()) / 1e9

    assert n_params("synthetic:glm-4.5-air") == pytest.approx(106.85, abs=0.01)  # "106 B total parameters"
    assert synthetic.config_for("synthetic:glm-4.5-air-L3")["num_hidden_layers"] == 3


def test_synthetic_glm_runs(monkeypatch):
    """The preset's recipe at a small width: generated weights load and decode finite logits."""
    from engine.api import Engine, EngineConfig
    from engine.models import synthetic

    small = dict(synthetic.PRESETS["glm-4.5-air"], vocab_size=128, hidden_size=64, intermediate_size=96,
                 moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 n_routed_experts=8, num_experts_per_tok=2, num_hidden_layers=46)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-glm", small)
    engine = Engine(EngineConfig(model="synthetic:tiny-glm-L3", device="cpu", dtype="float32", max_context=64,
                                 max_batch=1))
    assert engine.parts.args.moe_layer_ids() == [1, 2]
    logits = engine_logits(engine, PROMPT, prefill=6)
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert len(engine.generate_ids(PROMPT, 4)) == 4


def test_gguf_header_gives_the_shape(tmp_path):
    """models/shape.py reads the header only (what the planner sizes): biases and norms from the names."""
    from engine.models.shape import model_args

    ref = tiny(seed=7, use_qk_norm=True)
    args = model_args(str(write_glm_gguf(ref, tmp_path / "m.gguf")))
    assert args.arch == "glm4_moe" and args.n_layers == 3 and args.qkv_bias and args.qk_norm
    assert args.moe_layer_ids() == [1, 2] and args.shared_expert_ffn_dim == 16 and args.rotary_dim == 8
