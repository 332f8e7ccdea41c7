"""GGUF export of DeepSeek-V2 (llama.cpp arch `deepseek2`): a tiny random transformers model written by
Tandem is read back by Tandem's loader exactly and run by llama.cpp (llama-cpp-python, CPU) with
Tandem's logits; a synthetic V2-Lite preset streams out the weights Tandem draws for it.

The tiny models have a dense first layer, MoE layers of 8 experts (top 2) with two shared experts,
routed scaling 1.5, YaRN RoPE (mscale = mscale_all_dim, as the published models), every norm drawn at
random, and either no q LoRA (V2-Lite's form) or one (V2's)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV2ForCausalLM"):
    pytest.skip("this transformers has no deepseek_v2", allow_module_level=True)

from test_gguf_export import VOCAB, check_synthetic_bf16_export, llamacpp_logits, tandem_logits

from engine.bench import gguf_export
from engine.bench.gguf_export_deepseek2 import interleave_rope_rows
from engine.errors import UnsupportedModelError
from engine.models.mla import deinterleave_rope_rows

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
TINY_PRESET = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
               "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
               "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2}


def _tiny_folder(path, q_lora_rank=None):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                           q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                           v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
                           first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.5,
                           max_position_embeddings=256, rope_parameters=dict(YARN), initializer_range=0.2,
                           tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = DeepseekV2ForCausalLM(cfg).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(11)
        for _, t in model.named_parameters():
            if t.dim() == 1:  # transformers sets the norms to ones
                t.copy_(1 + torch.randn(t.shape, generator=g) * 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[None, 24], ids=["lite", "q-lora"])
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-ds2")
    folder = _tiny_folder(d / "m", q_lora_rank=request.param)
    f32 = d / "tiny-f32.gguf"
    stats = gguf_export.export(str(folder), f32, dtype="f32")
    return {"folder": folder, "f32": f32, "stats": stats, "ref": tandem_logits(folder), "q_lora": request.param}


@pytest.fixture
def tiny_preset(monkeypatch):
    from engine.models import synthetic

    monkeypatch.setitem(synthetic.PRESETS, "tiny-ds2",
                        dict(synthetic.PRESETS["deepseek-v2-lite"], **TINY_PRESET))
    return "synthetic:tiny-ds2"


def test_file_has_llamacpp_names_layout_and_metadata(tiny):
    """The converter's form: RoPE rows interleaved as the checkpoint stores them, kv_b split."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    r = gguf.GGUFReader(tiny["f32"])
    tensors = {t.name: t for t in r.tensors}
    q = ["attn_q_a", "attn_q_a_norm", "attn_q_b"] if tiny["q_lora"] else ["attn_q"]
    attn = ["attn_norm", *q, "attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b", "attn_v_b", "attn_output", "ffn_norm"]
    dense = attn + ["ffn_gate", "ffn_up", "ffn_down"]
    moe = attn + ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                  "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    want = {"token_embd", "output_norm", "output"} | {f"blk.0.{k}" for k in dense} | \
        {f"blk.{i}.{k}" for i in (1, 2) for k in moe}
    assert {n.removesuffix(".weight") for n in tensors} == want
    assert len(tensors) == tiny["stats"]["tensors"]
    assert tensors["blk.1.attn_k_b.weight"].shape.tolist() == [16, 32, 4]  # GGUF dims {dn, r, nh}
    assert tensors["blk.1.attn_v_b.weight"].shape.tolist() == [32, 16, 4]  # {r, dv, nh}
    assert tensors["blk.1.ffn_gate_shexp.weight"].shape.tolist() == [64, 2 * 32]
    assert tensors["blk.1.attn_kv_a_norm.weight"].tensor_type.name == "F32"
    # the projections that feed RoPE hold the checkpoint's own rows (interleaved pairs), as converted
    hf = load_file(str(next(tiny["folder"].glob("*.safetensors"))))
    q_name = "q_b_proj" if tiny["q_lora"] else "q_proj"
    for gguf_name, hf_name in ((f"blk.2.{q[-1]}.weight", f"model.layers.2.self_attn.{q_name}.weight"),
                               ("blk.2.attn_kv_a_mqa.weight", "model.layers.2.self_attn.kv_a_proj_with_mqa.weight")):
        np.testing.assert_array_equal(np.array(tensors[gguf_name].data), hf[hf_name].numpy())
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    a = "deepseek2."
    assert meta["general.architecture"] == "deepseek2"
    assert (meta[a + "attention.head_count_kv"], meta[a + "attention.key_length"],
            meta[a + "attention.value_length"]) == (1, 32 + 8, 32)
    assert (meta[a + "attention.key_length_mla"], meta[a + "attention.value_length_mla"]) == (16 + 8, 16)
    assert (meta[a + "attention.kv_lora_rank"], meta[a + "attention.q_lora_rank"]) == (32, tiny["q_lora"] or 0)
    assert (meta[a + "rope.dimension_count"], meta[a + "leading_dense_block_count"]) == (8, 1)
    assert (meta[a + "feed_forward_length"], meta[a + "expert_feed_forward_length"]) == (96, 32)
    assert (meta[a + "expert_count"], meta[a + "expert_used_count"], meta[a + "expert_shared_count"]) == (8, 2, 2)
    assert meta[a + "expert_weights_scale"] == 1.5 and meta[a + "expert_weights_norm"] is False
    assert meta[a + "expert_gating_func"] == 1  # softmax
    assert meta[a + "rope.scaling.type"] == "yarn" and meta[a + "rope.scaling.factor"] == 4.0
    assert meta[a + "rope.scaling.original_context_length"] == 64
    assert meta[a + "rope.scaling.yarn_log_multiplier"] == pytest.approx(0.0707)


def test_tandem_reads_the_f32_export_exactly(tiny):
    """The writer is the inverse of the reader: the same tensors bit for bit, the same logits."""
    from engine.models.loader import load_checkpoint

    want = load_checkpoint(str(tiny["folder"]), torch.float32).tensors
    got = load_checkpoint(tiny["f32"], torch.float32).tensors
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    torch.testing.assert_close(tandem_logits(tiny["f32"]), tiny["ref"], atol=1e-5, rtol=0)


def test_llamacpp_runs_the_same_weights_f32(tiny):
    """llama.cpp's deepseek2 graph (CPU, fp32, F32 KV cache; absorbed MLA over the latent rows) on the
    F32 file gives Tandem's logits of the folder: 1e-4 absolute on logits of RMS 1.6 (max 9.5),
    observed 1.9e-5 without q LoRA and 8e-6 with it — fp32 in two summation orders. Writing the RoPE
    rows in rotate-half order instead moved them by 9.7; leaving out YaRN's log multiplier by 5.7."""
    ref = tiny["ref"]
    assert ref.abs().max() > 1.0 and ref.std() > 0.3  # not degenerate
    ours = llamacpp_logits(tiny["f32"])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_synthetic_bf16_export_streams_tandems_weights_and_llamacpp_runs_them(tmp_path, tiny_preset):
    """The bench's path: a synthetic V2-Lite-shaped preset (-L3: one dense layer, two MoE; the preset's
    YaRN ×40) exported in BF16 holds exactly the weights Tandem draws for it, and llama.cpp on that
    file gives Tandem's logits on it within bf16 activation rounding (llama.cpp's matmuls round
    activations to bf16): 0.1 absolute on logits of RMS 1.0, observed 0.027, every greedy token equal."""
    check_synthetic_bf16_export(f"{tiny_preset}-L3", tmp_path / "s.gguf", "deepseek2", 3)


def test_interleave_is_the_readers_inverse():
    w = torch.randn(3 * 10, 5)
    assert torch.equal(deinterleave_rope_rows(interleave_rope_rows(w, 3, 10, 6), 3, 10, 6), w)
    rows = interleave_rope_rows(torch.arange(10.0).reshape(10, 1), 1, 10, 6).flatten().tolist()
    assert rows == [0, 1, 2, 3, 4, 7, 5, 8, 6, 9]  # rotate-half [4 5 6 | 7 8 9] → pairs (4, 7) (5, 8) (6, 9)


@pytest.mark.parametrize("override, layers, match", [
    ({"attention_bias": True}, "-L2", "biases"),
    ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}, "-L2", "group"),
    ({"q_lora_rank": 24}, "", "q LoRA"),  # all 27 layers: llama.cpp takes the file for V2-Lite
    ({"rope_scaling": dict(YARN, mscale=1.0)}, "-L2", "mscale"),
    ({"n_shared_experts": 0}, "-L2", "shared"),
])
def test_refusals(tmp_path, tiny_preset, monkeypatch, override, layers, match):
    """What llama.cpp's deepseek2 graph would compute differently is refused before a byte is written."""
    from engine.models import synthetic

    monkeypatch.setitem(synthetic.PRESETS, "tiny-ds2", dict(synthetic.PRESETS["tiny-ds2"], **override))
    with pytest.raises(UnsupportedModelError, match=match):
        gguf_export.export(f"{tiny_preset}{layers}", tmp_path / "a.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


def test_the_suites_fit_counts_the_latent_rows_only(tiny):
    """llama.cpp caches MLA's K rows (r + dr, f16) and no V: what -ncmoe's fit in the suite reserves."""
    from engine.bench import suite_files

    sizes = suite_files.gguf_sizes(tiny["f32"])
    assert sizes["kv_bytes_per_token"] == 2 * (32 + 8) * 3
    assert len(sizes["expert_bytes"]) == 2  # the MoE layers' stacks, for -ncmoe to move
