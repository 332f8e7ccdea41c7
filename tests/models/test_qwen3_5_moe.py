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


# -- the recurrent state across steps, chunks and chat turns --------------------------------------

def _prefill(engine, sid, ids):
    p, kv = engine.parts, engine.parts.kv
    positions = kv.begin_step([sid], len(ids))
    out = p.model(torch.tensor([ids]), positions, kv, last_only=False)[0]
    kv.end_step()
    return out


@torch.inference_mode()
def test_crop_restores_the_state_of_an_earlier_step(tmp_path):
    """A decode step whose token is dropped again (the generator runs one step ahead) is cropped
    away: the state goes back to the snapshot, and the next tokens see exactly the kept prefix."""
    engine = tiny_engine(write_layout(tiny(seed=4), tmp_path / "m", "fused"))
    kv = engine.parts.kv
    first, dropped, rest = PROMPT[:8], [50], PROMPT[8:]
    whole = _prefill(engine, sid := kv.new_sequence(), PROMPT)
    kv.free(sid)
    sid = kv.new_sequence()
    _prefill(engine, sid, first)
    _prefill(engine, sid, dropped)
    assert kv.resume_point(sid, len(first)) == len(first)
    kv.crop(sid, len(first))
    assert kv.length(sid) == len(first)
    torch.testing.assert_close(_prefill(engine, sid, rest), whole[len(first):], atol=FP32_ATOL, rtol=0)
    assert kv.resume_point(sid, 3) == 0  # no state was kept at 3 tokens: a crop there starts over
    kv.free(sid)


def test_second_turn_prefills_only_the_new_tokens(tmp_path):
    """Turn two (turn one's prompt, its reply, a new message) reads only the new tokens and answers as
    a fresh chat given the whole history; asking it again (regenerate) resumes from the state kept one
    token before the prompt's end (one token read) and answers the same; an edit of an earlier token
    reads the prompt again from the start."""
    from engine.api import GenerationRequest

    engine = tiny_engine(write_layout(tiny(seed=5), tmp_path / "m", "fused"))
    turn1 = [(5 * i + 1) % 96 for i in range(30)]
    r1 = engine.generate(GenerationRequest(prompt_ids=turn1, max_new_tokens=6, greedy=True, session_id="c"))
    assert r1.prefilled_tokens == len(turn1)
    new = [9, 8, 7, 6, 5, 4, 3, 2, 1, 11]
    turn2 = turn1 + r1.token_ids + new
    r2 = engine.generate(GenerationRequest(prompt_ids=turn2, max_new_tokens=6, greedy=True, session_id="c"))
    assert r2.prefilled_tokens <= len(new) + 1  # (+1: the reply's last token was chosen, never fed)
    fresh = engine.generate(GenerationRequest(prompt_ids=turn2, max_new_tokens=6, greedy=True, session_id="f"))
    assert fresh.prefilled_tokens == len(turn2) and r2.token_ids == fresh.token_ids
    again = engine.generate(GenerationRequest(prompt_ids=turn2, max_new_tokens=6, greedy=True, session_id="c"))
    assert again.token_ids == r2.token_ids and again.prefilled_tokens == 1
    edited = turn2[:5] + [0] + turn2[6:]
    r3 = engine.generate(GenerationRequest(prompt_ids=edited, max_new_tokens=6, greedy=True, session_id="c"))
    fresh3 = engine.generate(GenerationRequest(prompt_ids=edited, max_new_tokens=6, greedy=True, session_id="g"))
    assert r3.prefilled_tokens == len(edited) and r3.token_ids == fresh3.token_ids


def test_prompt_longer_than_a_prefill_chunk(tmp_path):
    """600 tokens: the generator prefills 512 + 88 (PREFILL_CHUNK), the state carried between the
    two forwards. The oracle is transformers' forward over the prompt and our reply: each of our
    greedy tokens is its argmax there, and the logits agree. (Its generate() drifts from its own
    forward after this long a prompt, by its cached decode path, from the fourth token on.)"""
    from engine.runtime.generator import PREFILL_CHUNK

    ref = tiny(seed=6, max_position_embeddings=1024)
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "fused"))
    prompt = [(11 * i + 5) % 96 for i in range(600)]
    assert len(prompt) > PREFILL_CHUNK
    reply = engine.generate_ids(prompt, 6)
    theirs = hf_logits(ref, prompt + reply)
    assert theirs[len(prompt) - 1:-1].argmax(-1).tolist() == reply
    torch.testing.assert_close(engine_logits(engine, prompt + reply, prefill=len(prompt)), theirs,
                               atol=FP32_ATOL, rtol=0)


# -- sizes, the planner, the preset ---------------------------------------------------------------

def test_sizes_count_every_weight_and_a_quarter_of_the_kv(tmp_path):
    """model_parts (headers only) against the assembled model's own parameters; KV per token for the
    full-attention layer only; the recurrent state per chat (current + snapshots, fp32)."""
    from engine.kv.recurrent import STATES_PER_SEQUENCE
    from engine.models.sizes import model_parts

    engine = tiny_engine(write_layout(tiny(seed=7), tmp_path / "m", "fused"))
    args = engine.parts.args
    parts = model_parts(args, 4, "tiny")
    held = sum(p.numel() for p in engine.parts.model.parameters()) * 4  # routed experts are not parameters
    assert abs(parts.dense_bytes - held) < 4 * args.n_layers  # (the per-layer mean is rounded down)
    assert parts.routed_bytes == 4 * 4 * 8 * 3 * 32 * 16 and parts.kv_layers == 1  # bytes, layers, experts, (3, H, I)
    assert parts.kv_bytes_per_token == 2 * 1 * 2 * 16 * 4  # K and V, one layer, 2 KV heads of 16, fp32
    state = 4 * (4 * 8 * 8 + (2 * 2 * 8 + 4 * 8) * 3)  # S (nv, dk, dv) and the conv's last 3 inputs
    assert parts.state_bytes_per_chat == 3 * state * STATES_PER_SEQUENCE


def test_preset_has_the_published_shape():
    """synthetic:qwen3.5-35b-a3b: 34.7 B parameters counted (the text model), KV in 10 of 40 layers;
    -L<n> cuts keep every fourth layer full attention."""
    from engine.models import families, synthetic
    from engine.models.sizes import model_parts

    config = synthetic.config_for("synthetic:qwen3.5-35b-a3b")
    args = families.for_model_type(config["model_type"], None).args_from_config(config)
    parts = model_parts(args, 2, "synthetic:qwen3.5-35b-a3b")
    assert parts.weights_bytes / 2 / 1e9 == pytest.approx(34.66, abs=0.01)
    assert args.kv_layer_ids() == list(range(3, 40, 4)) and args.rotary_dim == 64 and args.max_position == 262144
    assert parts.kv_bytes_per_token == 10 * 2 * 2 * 256 * 2  # a dense model of 40 such layers: four times this
    cut = synthetic.config_for("synthetic:qwen3.5-35b-a3b-L8")
    assert families.get("qwen3_5_moe").args_from_config(cut).kv_layer_ids() == [3, 7]


def test_plan_counts_a_quarter_of_the_kv_and_the_state(monkeypatch):
    """The whole preset on a 24 GiB GPU and 128 GiB of RAM (costs given, headers only): the experts
    do not fit the GPU and are offloaded; the KV is 10 layers' KV plus the chat's recurrent state."""
    from engine.api import EngineConfig
    from engine.runtime import planning
    from engine.sched.expert_cost import ExpertCostModel
    from engine.sched.placement import GiB, MachineCosts
    from engine.sched.roofline import RooflineParams

    kv = RooflineParams(A_ns_per_token=100.0, B_ns_per_token=40.0, delta_ms=0.1)
    costs = MachineCosts(gpu=True, vram_bytes=24 * GiB, ram_bytes=128 * GiB,
                         experts=ExpertCostModel.from_shape(2048, 512, 2), kv=kv, dram_gbps=90.0)
    monkeypatch.setattr(planning, "machine_costs", lambda *a, **k: costs)
    config = EngineConfig(model="synthetic:qwen3.5-35b-a3b", device="cpu", simulate_hybrid=True, dtype="bfloat16",
                          max_context=32768, max_batch=1)
    plan = planning.placement_plan(config)
    assert plan.fits and plan.device == "gpu" and plan.expert_policy in ("adaptive", "cpu-only")
    state = 30 * 4 * (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3) * 5  # 30 layers, fp32, ×5: current,
    # two snapshots, the kept one, the row of a captured step's fixed buffers
    kv_bytes = 32768 * 10 * 2 * 2 * 256 * 2 + state  # 10 layers × K and V × 2 heads × 256, bf16
    row = next(r for r in plan.rows if r.part.startswith("KV cache"))
    assert row.bytes == kv_bytes


def test_synthetic_recipe_runs(monkeypatch):
    """The preset's recipe at a small width, cut to 5 layers (-L5: layer 3 full attention): generated
    weights load, decode finite logits, and the recurrent state is carried (a second run from a fresh
    state gives the same tokens)."""
    from engine.api import Engine, EngineConfig
    from engine.models import synthetic

    small = dict(synthetic.PRESETS["qwen3.5-35b-a3b"], vocab_size=128, hidden_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-qwen3.5", small)
    engine = Engine(EngineConfig(model="synthetic:tiny-qwen3.5-L5", device="cpu", dtype="float32", max_context=128,
                                 max_batch=1))
    assert engine.parts.args.kv_layer_ids() == [3] and engine.parts.args.rotary_dim == 8
    logits = engine_logits(engine, PROMPT, prefill=6)
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    out = engine.generate_ids(PROMPT, 6)
    assert len(out) == 6 and engine.generate_ids(PROMPT, 6) == out
