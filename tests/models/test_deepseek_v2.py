"""DeepSeek-V2 (MLA) against transformers' DeepseekV2ForCausalLM on tiny random configs (fp32, CPU).

The baby models have a dense first layer, MoE layers with a shared expert and softmax routing, and
multi-head latent attention whose KV is cached as latent rows (r + dr wide, no V) and attended in
the absorbed form; variants add a q LoRA, group-limited top-k, routed scaling, attention biases and
YaRN RoPE (its mscale in the softmax scale). Tolerance: moe_helpers.FP32_ATOL (1e-4 absolute on O(1)
logits; the absorbed form sums in another order than the expanded one), greedy tokens equal.
"""

import json

import numpy as np
import pytest
import torch

from engine.kernels import attention_mla_native

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV2ForCausalLM"):
    pytest.skip("this transformers has no deepseek_v2", allow_module_level=True)
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM  # noqa: E402

from moe_helpers import PROMPT, assert_parity, build_hf, engine_logits, tiny_engine, write_layout  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}


def tiny(seed: int = 0, **overrides):
    heads = overrides.get("num_attention_heads", 4)
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
               num_hidden_layers=3, num_attention_heads=heads, num_key_value_heads=heads,  # MLA needs nh = n_kv
               q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
               topk_method="greedy", max_position_embeddings=256, initializer_range=0.2,
               tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.update(overrides)
    model = build_hf(DeepseekV2Config, DeepseekV2ForCausalLM, seed=seed, **cfg)
    with torch.no_grad():  # transformers initialises biases and norms plainly: make them matter
        g = torch.Generator().manual_seed(seed + 100)
        for name, t in model.named_parameters():
            if name.endswith(".bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
            elif name.endswith("layernorm.weight"):
                t.copy_(1 + torch.randn(t.shape, generator=g) * 0.2)
    return model


def test_saved_folder_matches_transformers(tmp_path):
    """save_pretrained's folder read back by both sides: dense layer 0, MoE layers with a shared expert,
    no q LoRA (V2-Lite's form); the KV holds latent rows only."""
    from engine.kv.latent import LatentResidentKV

    tiny().save_pretrained(tmp_path / "m")
    ref = DeepseekV2ForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32,
                                                attn_implementation="eager").eval()
    engine = tiny_engine(tmp_path / "m")
    info, args = engine.info(), engine.parts.args
    assert info["family"] == "deepseek_v2" and info["experts"] == 8
    assert args.moe_layer_ids() == [1, 2] and args.shared_expert_ffn_dim == 16
    assert (args.n_kv_heads, args.head_dim, args.rotary_dim) == (1, 16 + 4, 4)
    kv = engine.parts.kv
    assert isinstance(kv, LatentResidentKV) and kv.v is None and kv.k.shape[-2:] == (1, 20)
    assert type(engine.parts.model.model.layers[0].self_attn).__name__ == "MLAttention"
    assert_parity(engine, ref)


def test_q_lora_groups_scaling_biases(tmp_path):
    """DeepSeek-V2's full form: q through a LoRA with its norm, group-limited top-k (4 groups, best 2),
    routed_scaling_factor, biases on the a-projections and o_proj, two dense layers, per-expert names."""
    ref = tiny(seed=1, q_lora_rank=12, n_routed_experts=16, num_experts_per_tok=3, topk_method="group_limited_greedy",
               n_group=4, topk_group=2, routed_scaling_factor=2.5, attention_bias=True,
               first_k_dense_replace=2, num_hidden_layers=4, n_shared_experts=2)
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "per_expert"))
    args = engine.parts.args
    assert args.mla.q_lora_rank == 12 and args.router_groups == 4 and args.router_groups_used == 2
    assert args.moe_layer_ids() == [2, 3] and args.routed_scaling == 2.5 and args.qkv_bias
    assert_parity(engine, ref)


def test_groups_change_the_choice(tmp_path):
    """Guard: the group limit really moves experts (the same weights routed greedily differ)."""
    kw = dict(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=1)
    ref = tiny(seed=2, topk_method="group_limited_greedy", **kw)
    limited = engine_logits(tiny_engine(write_layout(ref, tmp_path / "g", "fused")), PROMPT)
    ref.config.topk_method = "greedy"
    greedy = engine_logits(tiny_engine(write_layout(ref, tmp_path / "n", "fused")), PROMPT)
    assert (limited - greedy).abs().max() > 1e-2


@pytest.mark.parametrize("mscales", [(0.707, 0.707), (1.0, 0.5)])
def test_yarn_rope_and_its_softmax_scale(tmp_path, mscales):
    """YaRN as the published models scale it (mscale = mscale_all_dim: the cos/sin factor is 1, the
    softmax scale gains mscale²), and with the two apart (a cos/sin factor ≠ 1 too)."""
    from engine.models.mla import yarn_mscale

    rope = dict(YARN, mscale=mscales[0], mscale_all_dim=mscales[1])
    ref = tiny(seed=3, rope_parameters=rope)
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "fused"))
    expected_scale = (8 + 4) ** -0.5 * yarn_mscale(4.0, mscales[1]) ** 2
    assert engine.parts.args.mla.softmax_scale == pytest.approx(expected_scale)
    assert engine.parts.args.rope_inv_freq is not None
    assert_parity(engine, ref)


def test_batched_decode_of_unequal_lengths(tmp_path):
    """Two sequences of different lengths decoding in one step (padded latent rows masked out) give
    each sequence's own logits."""
    ref = tiny(seed=4)
    engine = tiny_engine(write_layout(ref, tmp_path / "m", "fused"))
    p, kv = engine.parts, engine.parts.kv
    prompts = [PROMPT[:5], PROMPT[:9]]
    with torch.inference_mode():
        ids = [kv.new_sequence() for _ in prompts]
        for sid, prompt in zip(ids, prompts):
            positions = kv.begin_step([sid], len(prompt))
            p.model(torch.tensor([prompt]), positions, kv)
            kv.end_step()
        positions = kv.begin_step(ids, 1)
        both = p.model(torch.tensor([[7], [7]]), positions, kv)  # (2, vocab)
        kv.end_step()
    for row, prompt in zip(both, prompts):
        expected = ref(torch.tensor([prompt + [7]])).logits[0, -1]
        torch.testing.assert_close(row, expected.detach(), atol=1e-4, rtol=0)


def test_fixed_shape_decode_equals_the_gathered_one(tmp_path):
    """The graph-replayable decode (every block of each table read, masked by key counts; on CUDA by
    default) gives the logits of the decode that gathers only the rows in use, for a padded batch."""
    from engine.kv.latent import LatentResidentKV

    engine = tiny_engine(write_layout(tiny(seed=12), tmp_path / "m", "fused"), max_context=64)
    p, gathered = engine.parts, engine.parts.kv
    fixed = LatentResidentKV(p.args.n_layers, 20, 16, max_context=64, max_batch=2, block_size=gathered.block_size,
                             device=p.device, dtype=torch.float32, fixed_decode=True)

    def decode(kv):
        ids, rows = [kv.new_sequence() for _ in range(2)], []
        for sid, prompt in zip(ids, (PROMPT[:5], PROMPT[:11])):
            positions = kv.begin_step([sid], len(prompt))
            p.model(torch.tensor([prompt]), positions, kv)
            kv.end_step()
        for token in (7, 8, 9):
            positions = kv.begin_step(ids, 1)
            assert kv.replayable_step() == (kv is fixed)
            rows.append(p.model(torch.tensor([[token], [token]]), positions, kv))  # (2, vocab)
            kv.end_step()
        return torch.stack(rows)

    with torch.inference_mode():
        torch.testing.assert_close(decode(fixed), decode(gathered), atol=1e-5, rtol=0)  # fp32, other summation order


@pytest.mark.parametrize("policy", ["writescope", "fixed:0.5", "cpu-centric", "gpu-centric"])
def test_hybrid_kv_over_latent_rows_equals_resident(tmp_path, policy):
    """Simulated hybrid: latent rows placed in the D-window, the pinned region (streamed through
    ping-pong) and the unpinned region (the CPU side), attended per part and merged by LSE, give
    resident's logits and tokens. A small D-window and block make a 12-token prompt and 20 decode
    steps place rows in every region. Tolerance: the parts sum in another order, fp32: 1e-5."""
    folder = write_layout(tiny(seed=5), tmp_path / "m", "fused")
    resident = tiny_engine(folder, max_context=64)
    hybrid = tiny_engine(folder, kv_policy=policy, simulate_hybrid=True, d_window=8, block_size=4, max_context=64)
    kv = hybrid.parts.kv
    assert type(kv).__name__ == "LatentWriteScopeKV" and kv.cache.head_dim == 10  # (16 + 4) / 2 per plane
    assert hybrid.generate_ids(PROMPT, 20) == resident.generate_ids(PROMPT, 20)
    torch.testing.assert_close(engine_logits(hybrid, PROMPT + PROMPT, prefill=6),
                               engine_logits(resident, PROMPT + PROMPT, prefill=6), atol=1e-5, rtol=0)
    sid = kv.new_sequence()  # a long prefill places rows in the host regions at once
    with torch.inference_mode():
        positions = kv.begin_step([sid], 40)
        hybrid.parts.model(torch.tensor([list(range(40))]), positions, kv)
        kv.end_step()
    tokens = kv.telemetry()["tokens"]
    assert tokens["pinned"] + tokens["unpinned"] > 0  # (writescope's share follows its roofline: either side)
    if policy in ("fixed:0.5", "gpu-centric"):
        assert tokens["pinned"] > 0
    if policy in ("fixed:0.5", "cpu-centric"):
        assert tokens["unpinned"] > 0
    if tokens["unpinned"]:
        cpu_kernel = "native-mla" if attention_mla_native.available() else "torch-mla"  # reads each row once
        assert kv.telemetry()["cpu_kernel"] == cpu_kernel
    kv.free(sid)


HYBRID = {"kv_policy": "fixed:0.5", "simulate_hybrid": True, "d_window": 8, "block_size": 4}


@pytest.mark.parametrize("kv", [{}, HYBRID])
def test_a_cropped_sequence_continues_like_a_fresh_one(tmp_path, kv):
    """Regenerate and edit crop the latent rows (resident blocks, or the hybrid regions' tails):
    decoding on from the cut gives the logits of a sequence that never had the tail."""
    folder = write_layout(tiny(seed=10), tmp_path / "m", "fused")
    engine = tiny_engine(folder, max_context=64, **kv)
    p, cache = engine.parts, engine.parts.kv

    def step(sid, ids):
        positions = cache.begin_step([sid], len(ids))
        out = p.model(torch.tensor([ids]), positions, cache)[0]  # (vocab,) of the last position
        cache.end_step()
        return out

    long = PROMPT * 3  # 36 tokens: rows placed past the D-window in the hybrid case
    with torch.inference_mode():
        cut = cache.new_sequence()
        step(cut, long)
        cache.crop(cut, 14)
        assert cache.length(cut) == 14
        resumed = [step(cut, [t]) for t in (7, 9, 11)]
        fresh = cache.new_sequence()
        step(fresh, long[:14])
        expected = [step(fresh, [t]) for t in (7, 9, 11)]
    for a, b in zip(resumed, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # fp32, the same keys merged in another order


# -- the synthetic preset ---------------------------------------------------------------------------

def test_config_of_the_published_shape_reads():
    """The preset's config (DeepSeek-V2-Lite) gives the published layer plan and MLA widths."""
    from engine.models import synthetic
    from engine.models.deepseek_v2 import args_from_config

    args = args_from_config(json.loads(json.dumps(synthetic.config_for("synthetic:deepseek-v2-lite"))))
    assert args.n_layers == 27 and args.moe_layer_ids() == list(range(1, 27))
    assert (args.n_experts, args.top_k, args.expert_ffn_dim, args.shared_expert_ffn_dim) == (64, 6, 1408, 2816)
    m = args.mla
    assert (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (512, 128, 64, 128)
    assert m.q_lora_rank is None and m.row_width == 576
    assert m.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 0.707 * np.log(40) + 1) ** 2)


def test_preset_has_the_published_size():
    """DeepSeek-V2-Lite: "15.7B total parameters"; its latent KV is 576 values per token and layer."""
    from engine.models import families, synthetic
    from engine.models.assemble import tensor_shapes
    from engine.models.sizes import model_parts

    config = synthetic.config_for("synthetic:deepseek-v2-lite")
    args = families.for_model_type(config["model_type"], "x").args_from_config(config)
    n_params = sum(torch.Size(s).numel() for s in tensor_shapes(args).values())
    assert n_params / 1e9 == pytest.approx(15.71, abs=0.01)
    parts = model_parts(args, 2, "synthetic:deepseek-v2-lite")
    assert parts.kv_bytes_per_token == 27 * 576 * 2  # bf16, no V
    dense = parts.embed_bytes + parts.output_bytes + parts.layer_dense_bytes * 27
    experts = parts.expert_bytes * parts.n_experts * parts.moe_layers
    assert (dense + experts) / 2 == pytest.approx(n_params, rel=1e-3)  # the planner counts what the model holds
    assert synthetic.config_for("synthetic:deepseek-v2-lite-L4")["num_hidden_layers"] == 4


def test_synthetic_deepseek_runs(monkeypatch):
    """The preset's recipe at a small width: generated weights load and decode finite logits."""
    from engine.api import Engine, EngineConfig
    from engine.models import synthetic

    small = dict(synthetic.PRESETS["deepseek-v2-lite"], vocab_size=128, hidden_size=64, intermediate_size=96,
                 moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-deepseek", small)
    engine = Engine(EngineConfig(model="synthetic:tiny-deepseek-L3", device="cpu", dtype="float32", max_context=64,
                                 max_batch=1))
    assert engine.parts.args.moe_layer_ids() == [1, 2]
    logits = engine_logits(engine, PROMPT, prefill=6)
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert len(engine.generate_ids(PROMPT, 4)) == 4


# -- CUDA, bf16 (skipped without a CUDA GPU) --------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.filterwarnings("error:An output with one or more elements was resized")  # graph outputs sized for r
@pytest.mark.parametrize("kv", [{}, {"kv_policy": "fixed:0.5", "d_window": 8, "block_size": 4, "max_context": 64}])
def test_bf16_cuda_matches_transformers(tmp_path, kv):
    """The bar of test_cuda_parity.py: against the fp32 forward of the same weights, our bf16 logits
    may err at most twice as much as transformers' bf16 logits (+0.02); greedy tokens equal theirs
    up to a first divergence at a near-tie of the fp32 model (margin < 0.1). Resident latent KV, and
    the hybrid format over CUDA streams (rows in the D-window, streamed pinned and CPU regions)."""
    from moe_helpers import N_NEW, hf_greedy, hf_logits

    tiny(seed=11, q_lora_rank=12, rope_parameters=dict(YARN)).save_pretrained(tmp_path / "m")
    exact = DeepseekV2ForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    ref = DeepseekV2ForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16,
                                                attn_implementation="eager").cuda().eval()
    engine = tiny_engine(tmp_path / "m", device="cuda", dtype="bfloat16", **kv)
    long_prompt = PROMPT * 3  # 36 tokens: past the D-window of the hybrid case
    truth = hf_logits(exact, long_prompt)
    their_err = (hf_logits(ref, long_prompt) - truth).abs().max().item()
    for prefill in (None, 3):
        ours = engine_logits(engine, long_prompt, prefill=prefill)
        assert (ours - truth).abs().max().item() <= 2 * their_err + 0.02
    mine, expected = engine.generate_ids(PROMPT, N_NEW), hf_greedy(ref, PROMPT)
    if mine != expected:
        j = next(i for i, (a, b) in enumerate(zip(mine, expected)) if a != b)
        row = hf_logits(exact, PROMPT + expected[:j])[-1]
        assert abs(row[mine[j]] - row[expected[j]]).item() < 0.1, f"diverged at token {j} without a near-tie"
    if kv:  # decode steps replayed the streamed loads as CUDA graphs (their outputs r wide)
        assert engine.parts.kv.telemetry()["stream_graphs"]["replays"] > 0
    engine.close()
