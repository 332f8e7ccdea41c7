"""GGUF export of Qwen3.5-MoE (llama.cpp arch `qwen35moe`): a tiny random transformers model written
by Tandem is read back by Tandem's loader exactly and run by llama.cpp (llama-cpp-python, CPU) with
Tandem's logits; a synthetic preset streams out the weights Tandem draws for it.

The tiny model has four value heads on two key heads (so the value-head tiling matters), three
DeltaNet layers and a full-attention one, and every 1-D parameter (norms, A_log, dt_bias) drawn
at random, so that each of them moves the logits."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
    pytest.skip("this transformers has no qwen3_5_moe", allow_module_level=True)

from test_gguf_export import VOCAB, check_synthetic_bf16_export, llamacpp_logits, tandem_logits

from engine.bench import gguf_export, gguf_export_qwen3_5
from engine.errors import UnsupportedModelError

TINY_PRESET = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
               "linear_num_value_heads": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
               "num_experts": 8, "num_experts_per_tok": 2}


def _tiny_folder(path):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                               moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8,
                               num_experts_per_tok=2, max_position_embeddings=512, initializer_range=0.2,
                               tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(103)
        for _, t in model.named_parameters():
            if t.dim() == 1:  # transformers sets these to constants
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf35")
    folder = _tiny_folder(d / "m")
    f32 = d / "tiny-f32.gguf"
    stats = gguf_export.export(str(folder), f32, dtype="f32")
    return {"folder": folder, "f32": f32, "stats": stats, "ref": tandem_logits(folder)}


@pytest.fixture
def tiny_preset(monkeypatch):
    from engine.models import synthetic

    monkeypatch.setitem(synthetic.PRESETS, "tiny-qwen3.5", dict(synthetic.PRESETS["qwen3.5-35b-a3b"], **TINY_PRESET))
    return "synthetic:tiny-qwen3.5"


def test_file_has_llamacpp_names_layout_and_metadata(tiny):
    import gguf
    import numpy as np

    r = gguf.GGUFReader(tiny["f32"])
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == tiny["stats"]["tensors"] == 3 + 3 * 19 + 16  # globals, DeltaNet layers, the full layer
    assert tensors["blk.0.attn_qkv.weight"].shape.tolist() == [64, 2 * 2 * 8 + 4 * 8]  # GGUF dims: {H, C}
    assert tensors["blk.0.ssm_conv1d.weight"].shape.tolist() == [4, 64]  # {K, C}: the (C, 1, K) kernel squeezed
    assert tensors["blk.0.ssm_conv1d.weight"].tensor_type.name == "F32"
    assert tensors["blk.3.attn_q.weight"].shape.tolist() == [64, 2 * 4 * 16]  # each head's [q | gate]
    assert tensors["blk.1.ffn_gate_inp_shexp.weight"].shape.tolist() == [64]
    assert "blk.3.attn_qkv.weight" not in tensors and "blk.0.attn_q.weight" not in tensors
    # ssm_a is −exp(A_log) with the value heads tiled: [v0 of k0, v0 of k1, v1 of k0, v1 of k1]
    from safetensors.torch import load_file

    a_log = load_file(str(next(tiny["folder"].glob("*.safetensors"))))["model.layers.0.linear_attn.A_log"]
    want = -a_log.float().exp().reshape(2, 2).T.reshape(-1)
    np.testing.assert_allclose(np.array(tensors["blk.0.ssm_a"].data), want.numpy(), rtol=1e-6)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert meta["general.architecture"] == "qwen35moe"
    assert meta["qwen35moe.rope.dimension_count"] == 4  # a quarter of the 16-dim heads
    assert meta["qwen35moe.rope.dimension_sections"] == [1, 1, 0, 0]
    assert meta["qwen35moe.attention.recurrent_layers"] == [True, True, True, False]
    assert (meta["qwen35moe.ssm.group_count"], meta["qwen35moe.ssm.time_step_rank"]) == (2, 4)
    assert (meta["qwen35moe.ssm.state_size"], meta["qwen35moe.ssm.inner_size"]) == (8, 32)
    assert meta["qwen35moe.expert_shared_feed_forward_length"] == 24


def test_tandem_reads_the_f32_export_exactly(tiny):
    """The writer is the inverse of the reader (observed bit-identical logits)."""
    torch.testing.assert_close(tandem_logits(tiny["f32"]), tiny["ref"], atol=1e-5, rtol=0)


def test_llamacpp_runs_the_same_weights_f32(tiny):
    """llama.cpp's qwen35moe graph (CPU, fp32, F32 KV cache) on the F32 file gives Tandem's logits of
    the folder: 3e-4 absolute on logits of RMS 1.7 (max 9.2), observed 1.4e-4 — fp32 in two summation
    orders: against transformers in float64 Tandem is off by 1.1e-4 and llama.cpp by 3e-5. Leaving
    the value heads grouped instead of tiled moved them by 11."""
    ref = tiny["ref"]
    assert ref.abs().max() > 1.0 and ref.std() > 0.3  # not degenerate
    ours = llamacpp_logits(tiny["f32"])
    torch.testing.assert_close(ours, ref, atol=3e-4, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_synthetic_bf16_export_streams_tandems_weights_and_llamacpp_runs_them(tmp_path, tiny_preset):
    """The bench's path: a synthetic preset (-L5: layers 0-2 and 4 DeltaNet, 3 full) exported in BF16
    holds exactly the weights Tandem draws for it, and llama.cpp on that file gives Tandem's logits on
    it within bf16 activation rounding (llama.cpp's matmuls round activations to bf16): 0.1 absolute
    on logits of RMS 1.0, observed 0.06, every greedy token equal."""
    check_synthetic_bf16_export(f"{tiny_preset}-L5", tmp_path / "s.gguf", "qwen35moe", 5)


def test_refusals_and_rope_sections(tmp_path, tiny_preset, monkeypatch):
    from engine.models import synthetic

    with pytest.raises(UnsupportedModelError, match="full-attention"):  # -L3: DeltaNet layers only
        gguf_export.export(f"{tiny_preset}-L3", tmp_path / "a.gguf")
    monkeypatch.setitem(synthetic.PRESETS, "tiny-qwen3.5", dict(synthetic.PRESETS["tiny-qwen3.5"],
                                                               linear_value_head_dim=32))
    with pytest.raises(UnsupportedModelError, match="head"):  # llama.cpp sizes value heads as key heads
        gguf_export.export(f"{tiny_preset}-L4", tmp_path / "b.gguf")
    assert not list(tmp_path.glob("*.gguf*"))
    release = synthetic.PRESETS["qwen3.5-35b-a3b"]
    assert gguf_export_qwen3_5.rope_sections(release, 64) == [11, 11, 10, 0]  # the release's own
    assert gguf_export_qwen3_5.rope_sections(release, 8) == [2, 1, 1, 0]  # 4 pairs: its 32 would not fit
