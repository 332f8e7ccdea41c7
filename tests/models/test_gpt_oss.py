"""gpt-oss against transformers' GptOssForCausalLM on tiny random configs (fp32, CPU).

The baby models alternate a 4-token sliding window with full attention (shorter than the 12-token
prompt, so prefill and decode both mask), have random attention sinks and random biases everywhere
(q/k/v/o, router, both expert projections), YaRN RoPE, and experts whose clamped SwiGLU is pushed
past its limit. Tolerance: moe_helpers.FP32_ATOL (1e-4 absolute on O(1) logits), greedy tokens equal.
"""

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GptOssForCausalLM"):
    pytest.skip("this transformers has no gpt_oss", allow_module_level=True)
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

from gguf_writers import finish  # noqa: E402
from moe_helpers import PROMPT, assert_parity, build_hf, engine_logits, hf_logits, tiny_engine  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}


def tiny(seed: int = 0, **overrides):
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
               max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
               rope_parameters=dict(YARN), bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.update(overrides)
    model = build_hf(GptOssConfig, GptOssForCausalLM, seed=seed, **cfg)
    with torch.no_grad():  # transformers initialises biases and sinks to zero: make them matter
        g = torch.Generator().manual_seed(seed + 100)
        for name, t in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            if name.endswith("experts.gate_up_proj"):
                t.mul_(8.0)  # pre-activations well past the ±7 clamp
    return model


def saved(tmp_path, model):
    model.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_saved_folder_matches_transformers(tmp_path):
    ref = tiny()
    engine = tiny_engine(saved(tmp_path, ref))
    args = engine.parts.args
    assert engine.info()["family"] == "gpt_oss" and engine.info()["experts"] == 8
    assert args.layer_windows == [4, None, 4, None] and args.attn_sinks and args.rope_attention_factor > 1.0
    assert_parity(engine, ref)


def test_clamp_is_reached():
    """Guard: the experts' pre-activations really pass the limit (else the clamp is untested)."""
    ref = tiny()
    x = ref.model.embed_tokens(torch.tensor(PROMPT))
    h = torch.einsum("th,ehi->eti", ref.model.layers[0].post_attention_layernorm(x), ref.model.layers[0].mlp.experts.gate_up_proj)
    assert h.abs().max() > 2 * 7.0


def test_sinks_and_windows_make_a_difference(tmp_path):
    """Guards: zero sinks and no windows give other logits than the model's."""
    ref = tiny(seed=1)
    theirs = hf_logits(ref, PROMPT)
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink nobody attends to: plain softmax
    no_sinks = hf_logits(ref, PROMPT)
    assert (theirs - no_sinks).abs().max() > 1e-2
    engine = tiny_engine(saved(tmp_path, ref))  # the sinks of -1e4 go through the engine as well
    torch.testing.assert_close(engine_logits(engine, PROMPT, prefill=3), no_sinks, atol=1e-4, rtol=0)
    wide = tiny(seed=1, sliding_window=64)
    assert (hf_logits(wide, PROMPT)[4:] - theirs[4:]).abs().max() > 1e-2


def test_all_full_attention_layers_and_plain_rope(tmp_path):
    ref = tiny(seed=2, layer_types=["full_attention"] * 4, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 10000.0})
    engine = tiny_engine(saved(tmp_path, ref))
    assert engine.parts.args.layer_windows == [None] * 4
    assert_parity(engine, ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter runs only where there is no GPU")
def test_paged_decode_honours_sinks_and_windows(tmp_path):
    """The resident KV's paged decode kernel (interpreted on the CPU): sinks through its LSE, the
    window per layer."""
    pytest.importorskip("triton")
    from engine.kv.resident import ResidentKV

    ref = tiny(seed=3)
    engine = tiny_engine(saved(tmp_path, ref))
    p, a = engine.parts, engine.parts.args
    p.kv = ResidentKV(a.n_layers, a.n_kv_heads, a.head_dim, max_context=64, max_batch=1, block_size=16,
                      device=p.device, dtype=p.dtype, paged_decode=True)
    torch.testing.assert_close(engine_logits(engine, PROMPT, prefill=3), hf_logits(ref, PROMPT), atol=1e-4, rtol=0)


@pytest.mark.parametrize("policy", ["adaptive", "on-demand", "cpu-only"])
def test_offloaded_experts_with_biases_generate_what_resident_generates(tmp_path, policy):
    """Simulated hybrid, 5 cache slots for 32 routed experts: the slots' grouped path and the CPU
    set both run the biases and the clamped SwiGLU; tokens and logits equal resident execution."""
    from engine.experts.offload import OffloadedExperts

    folder = saved(tmp_path, tiny(seed=4))
    resident = tiny_engine(folder, max_context=64)
    expected = resident.generate_ids(PROMPT, 8)
    offloaded = tiny_engine(folder, expert_policy=policy, simulate_hybrid=True, kv_policy="resident",
                            expert_cache_slots=5, max_context=64)
    ex = offloaded.parts.experts
    assert isinstance(ex, OffloadedExperts) and len(ex.forms) == 4
    # the whole-step graph's device table runs plain SwiGLU only: never opened for these experts
    assert ex.zero_copy is None and "biases" in ex.zero_copy_off
    # a decode graph's capture stand-ins take the layers' place without being asked for the form
    from engine.runtime.decode_graph import _Cut

    mlp = next(layer.mlp for layer in offloaded.parts.model.model.layers if getattr(layer.mlp, "experts", None) is ex)
    mlp.experts = _Cut(None, None)
    mlp.experts = ex
    assert offloaded.generate_ids(PROMPT, 8) == expected
    torch.testing.assert_close(engine_logits(offloaded, PROMPT, prefill=4), engine_logits(resident, PROMPT, prefill=4),
                               atol=1e-5, rtol=0)  # fp32 both; the same products summed in another order
    t = ex.telemetry()
    assert t["cpu_executed"] > 0 and (policy == "cpu-only" or t["fills"] > 0)


def test_the_planner_offloads_gpt_oss_experts_under_a_small_budget(tmp_path):
    """A budget that holds the dense weights (and the planner's reserve) but not the experts: the
    dense part runs on the GPU and the experts are offloaded, instead of all of it on the CPU."""
    from engine.api import EngineConfig, plan_placement

    folder = saved(tmp_path, tiny(seed=4))
    resident = tiny_engine(folder, max_context=64)
    budget = (resident.parts.weights_bytes * 2.0) / 2**30
    plan = plan_placement(EngineConfig(model=str(folder), backend="tandem", simulate_hybrid=True, dtype="float32",
                                       vram_budget_gb=budget, max_context=64, max_batch=1))
    assert plan["fits"] and plan["device"] == "gpu" and plan["expert_policy"] in ("adaptive", "cpu-only")


def test_resident_experts_say_which_kernel_runs(tmp_path):
    engine = tiny_engine(saved(tmp_path, tiny(seed=5)))
    assert "expert biases" in engine.parts.experts.telemetry()["kernel"]


# -- GGUF, as llama.cpp's converter writes gpt-oss --------------------------------------------------

_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp",
}


def write_oss_gguf(model, path):
    """llama.cpp's gpt-oss: experts split into gate and up (de-interleaved) in (out, in) order, their
    biases beside them, sinks as attn_sinks.weight, YaRN in the rope.scaling keys."""
    import gguf

    c = model.config
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd.pop("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", sd.pop("model.norm.weight"))
    w.add_tensor("output.weight", sd.pop("lm_head.weight"))
    for name, t in sd.items():
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # (E, H, 2I) interleaved
            gu = t.transpose(0, 2, 1)  # (E, 2I, H)
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gu[:, 0::2]))
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(gu[:, 1::2]))
        elif rest == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.bias", np.ascontiguousarray(t[:, 0::2]))
            w.add_tensor(f"blk.{layer}.ffn_up_exps.bias", np.ascontiguousarray(t[:, 1::2]))
        elif rest == "mlp.experts.down_proj":
            w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(t.transpose(0, 2, 1)))
        elif rest == "mlp.experts.down_proj_bias":
            w.add_tensor(f"blk.{layer}.ffn_down_exps.bias", np.ascontiguousarray(t))
        elif rest == "self_attn.sinks":
            w.add_tensor(f"blk.{layer}.attn_sinks.weight", np.ascontiguousarray(t))
        else:
            module, suffix = rest.rsplit(".", 1)
            w.add_tensor(f"blk.{layer}.{_NAMES[module]}.{suffix}", np.ascontiguousarray(t))
    return finish(w, path)


def test_gguf_round_trip(tmp_path):
    ref = tiny(seed=6)
    engine = tiny_engine(write_oss_gguf(ref, tmp_path / "m.gguf"))
    args = engine.parts.args
    assert engine.info()["family"] == "gpt_oss" and args.layer_windows == [4, None, 4, None]
    assert args.rope_attention_factor > 1.0
    assert_parity(engine, ref)


# -- the synthetic preset ---------------------------------------------------------------------------

def test_preset_has_the_published_shape():
    from engine.models import families, synthetic
    from engine.models.assemble import tensor_shapes

    config = synthetic.config_for("synthetic:gpt-oss-20b")
    args = families.for_model_type(config["model_type"], "x").args_from_config(config)
    assert (args.n_layers, args.dim, args.n_experts, args.top_k, args.expert_ffn_dim) == (24, 2880, 32, 4, 2880)
    assert (args.n_heads, args.n_kv_heads, args.head_dim, args.vocab_size) == (64, 8, 64, 201088)
    assert args.layer_windows == [128, None] * 12
    n = sum(torch.Size(s).numel() for s in tensor_shapes(args).values()) / 1e9
    assert n == pytest.approx(20.91, abs=0.01)  # "21 B parameters"


def test_synthetic_gpt_oss_runs(monkeypatch):
    from engine.api import Engine, EngineConfig
    from engine.models import synthetic

    small = dict(synthetic.PRESETS["gpt-oss-20b"], vocab_size=128, hidden_size=64, intermediate_size=32,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, sliding_window=4)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-oss", small)
    engine = Engine(EngineConfig(model="synthetic:tiny-oss-L2", device="cpu", dtype="float32", max_context=64,
                                 max_batch=1))
    logits = engine_logits(engine, PROMPT, prefill=6)
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert len(engine.generate_ids(PROMPT, 4)) == 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_experts_with_biases_decode_through_cuda_graphs(tmp_path):
    """On a GPU the decode step is captured in pieces cut at each MoE layer; the capture's stand-ins
    must not be refused for the experts' form, and the tokens equal resident execution (fp32)."""
    folder = saved(tmp_path, tiny(seed=4))
    expected = tiny_engine(folder, device="cuda", max_context=64).generate_ids(PROMPT, 8)
    offloaded = tiny_engine(folder, device="cuda", expert_policy="adaptive", kv_policy="resident",
                            expert_cache_slots=5, max_context=64)
    assert offloaded.generate_ids(PROMPT, 8) == expected
    assert offloaded.parts.experts.zero_copy is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_windows_and_sinks_through_flash_read_a_long_prompt_as_the_masked_path_does(tmp_path, monkeypatch):
    """bf16 on CUDA: sinks and 16-token windows go through flash (no mask), in one forward and in
    forwards after earlier ones, and follow the fp32 CPU as closely as the boolean-mask path in bf16
    does. (bf16 flips some routings of this baby model, so a few positions differ by O(1) either way:
    the per-position errors' median and the greedy tokens are compared; an ignored or misplaced window
    moves most positions.)"""
    from engine.kv.resident import ResidentKV

    folder = saved(tmp_path, tiny(seed=5, sliding_window=16, max_position_embeddings=512))
    ids = [(i * 37 + 11) % 96 for i in range(300)]
    cpu = engine_logits(tiny_engine(folder, max_context=512), ids, forward=300)
    gpu = tiny_engine(folder, device="cuda", dtype="bfloat16", max_context=512)
    assert gpu.parts.kv.flash_prefill and gpu.backend.generator.prefill_chunk == 2048
    flash = {chunk: engine_logits(gpu, ids, forward=chunk) for chunk in (300, 64)}
    monkeypatch.setattr(ResidentKV, "flash_prefill", property(lambda self: False))  # the boolean mask's path
    masked = engine_logits(gpu, ids, forward=300)
    error = lambda x: (x - cpu).abs().max(-1).values.median()  # noqa: E731 - per position, then the median
    for got in flash.values():
        assert error(got) <= 1.5 * error(masked) + 1e-2
        assert (got.argmax(-1) == cpu.argmax(-1)).float().mean() >= 0.85
