"""Models whose matrices mix block types (as llama.cpp's Q4_K_M, Q5_K_M and Q6_K files do): the loader
keeps every kernel type in blocks, and the model computes what the dequantised float32 model does.

Logit tolerance: every product over blocks rounds its activations to int16 per 32-block, at most 2^-16
of the block's largest value, about 1.5e-5 of Σ|w||x| per output (test_block_types.py); through two
layers of 7 products and the head that compounds to some 1e-4 of the logits' scale. Observed 4e-5 of
max |logit| over the tiny model's decode steps (its prefill, over dequantised tiles, matched exactly);
held to 1e-3 of it. AVX2's K-quant products read int8 activations instead (per 256 values, llama.cpp's
Q8_K): held to 4e-2, and a greedy answer may leave the dequantised one at a near tie
(helpers.quant_logit_tolerance, greedy_follows).
"""

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize
from helpers import greedy_follows, quant_logit_tolerance
from helpers import stepped_logits as logits

from engine.api import Engine, EngineConfig
from engine.models.loader import load_checkpoint
from engine.quant.blocks import QTYPES, QuantTensor
from engine.quant.modules import QuantLinear

DIMS = {"vocab": 96, "dim": 256, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 512, "ctx": 128}
# Q4_K_M's shape of mix: q/k one type, v another, gate/up Q4_K, down Q6_K or Q5_K by layer
TYPES = {"token_embd": T.Q6_K, "attn_q": T.Q5_0, "attn_k": T.Q5_0, "attn_v": T.Q8_0, "attn_output": T.Q5_1,
         "ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": (T.Q6_K, T.Q5_K)}
# fp16 factors of the K-quants' random blocks: weights of O(0.03)
K_HALVES = {T.Q4_K: {0: 3e-5, 2: 3e-5}, T.Q5_K: {0: 1.5e-5, 2: 3e-5}, T.Q6_K: {208: 8e-6}}
PROMPT = [3, 17, 5, 42, 8, 9, 33, 60, 2, 71, 11, 4, 19, 23, 50, 64, 7, 88, 1]  # 19: prefill over tiles


def _matrix(rng, rows, cols, qtype):
    """(rows, row bytes) of `qtype`: gguf's quantiser where it has one, else random blocks."""
    if qtype not in K_HALVES:
        return quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    qt = QTYPES[int(qtype)]
    data = rng.integers(0, 256, (rows, cols // qt.block_weights, qt.block_bytes), dtype=np.uint8)
    for at, size in K_HALVES[qtype].items():
        h = (rng.uniform(0.5, 1.0, data.shape[:2]) * size * rng.choice([-1, 1], data.shape[:2])).astype(np.float16)
        data[:, :, at:at + 2] = h.view(np.uint8).reshape(*data.shape[:2], 2)
    return data.reshape(rows, -1)


def write_mixed_llama(path, float_q_layer: int | None = None, up_type=None):
    """A 2-layer llama GGUF typed as TYPES says; float_q_layer: that layer's attn_q in F16 instead;
    up_type: every ffn_up's type instead of ffn_gate's."""
    import gguf

    c, rng = DIMS, np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c["layers"]); w.add_context_length(c["ctx"]); w.add_embedding_length(c["dim"])
    w.add_feed_forward_length(c["ffn"]); w.add_head_count(c["heads"]); w.add_head_count_kv(c["kv_heads"])
    w.add_rope_freq_base(10000.0); w.add_layer_norm_rms_eps(1e-5); w.add_vocab_size(c["vocab"])
    hd = c["dim"] // c["heads"]
    w.add_tensor("token_embd.weight", _matrix(rng, c["vocab"], c["dim"], TYPES["token_embd"]), raw_dtype=TYPES["token_embd"])
    w.add_tensor("output_norm.weight", np.ones(c["dim"], np.float32))
    for i in range(c["layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(c["dim"], np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(c["dim"], np.float32))
        shapes = {"attn_q": (c["heads"] * hd, c["dim"]), "attn_k": (c["kv_heads"] * hd, c["dim"]),
                  "attn_v": (c["kv_heads"] * hd, c["dim"]), "attn_output": (c["dim"], c["heads"] * hd),
                  "ffn_gate": (c["ffn"], c["dim"]), "ffn_up": (c["ffn"], c["dim"]), "ffn_down": (c["dim"], c["ffn"])}
        for kind, (rows, cols) in shapes.items():
            if kind == "attn_q" and i == float_q_layer:
                w.add_tensor(f"blk.{i}.{kind}.weight", (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16))
                continue
            qtype = TYPES[kind][i] if isinstance(TYPES[kind], tuple) else TYPES[kind]
            qtype = up_type if kind == "ffn_up" and up_type is not None else qtype
            w.add_tensor(f"blk.{i}.{kind}.weight", _matrix(rng, rows, cols, qtype), raw_dtype=qtype)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def engine_for(path, dtype="auto"):
    return Engine(EngineConfig(model=str(path), backend="tandem", device="cpu", max_batch=1, dtype=dtype))


def test_loader_keeps_each_type_and_its_values(tmp_path, caplog):
    path = write_mixed_llama(tmp_path / "mixed.gguf")
    with caplog.at_level(logging.WARNING, logger="tandem.loader"):
        kept = load_checkpoint(path, torch.float32, quantised=True).tensors
    assert not caplog.records  # nothing dequantised
    plain = load_checkpoint(path, torch.float32).tensors
    types = {n: t.qtype.name for n, t in kept.items() if isinstance(t, QuantTensor)}
    assert types["model.layers.0.mlp.down_proj.weight"] == "Q6_K"
    assert types["model.layers.1.mlp.down_proj.weight"] == "Q5_K"
    assert types["model.layers.0.mlp.gate_proj.weight"] == "Q4_K" and types["model.embed_tokens.weight"] == "Q6_K"
    assert {types[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkvo"} == {"Q5_0", "Q8_0", "Q5_1"}
    for name, t in kept.items():  # the blocks hold the file's weights, q/k rows un-permuted alike
        assert torch.equal(t.dequantize() if isinstance(t, QuantTensor) else t, plain[name]), name


@pytest.mark.parametrize("float_q_layer", [None, 1], ids=["all-blocks", "float-q-beside-block-kv"])
def test_mixed_model_logits_follow_the_dequantised_one(tmp_path, float_q_layer):
    """Prefill (19 tokens: dequantised tiles) and decode steps (the integer kernels). With one layer's
    q in F16 beside k and v in blocks, q/k/v stay unfused (blocks cannot join a float tensor)."""
    path = write_mixed_llama(tmp_path / "mixed.gguf", float_q_layer)
    quant, ref = engine_for(path), engine_for(path, dtype="float32")
    layers = quant.backend.parts.model.model.layers
    assert isinstance(layers[0].mlp.down_proj, QuantLinear) and isinstance(layers[1].mlp.up_proj, QuantLinear)
    assert isinstance(layers[1].self_attn.q_proj, QuantLinear) == (float_q_layer is None)
    assert all(layer.self_attn.qkv_weight is None for layer in layers)
    for prefill in (len(PROMPT), 12):
        got, want = logits(quant, PROMPT, prefill), logits(ref, PROMPT, prefill)
        scale = float(want.abs().max())
        assert scale > 0.1 and float((got - want).abs().max()) <= quant_logit_tolerance() * scale
    assert greedy_follows(quant, ref, PROMPT, 8)


@pytest.mark.parametrize("up_type", [None, T.Q6_K], ids=["gate-up-alike", "gate-up-differ"])
def test_upcycled_moe_over_mixed_blocks(tmp_path, monkeypatch, up_type):
    """The built-in MoE recipe over a mixed file: gate and up rows share one block tensor when they
    share a type (down may differ); when they differ the experts are dequantised, not refused."""
    from engine.models import builtin
    from engine.quant.experts import QuantResidentExperts

    path = write_mixed_llama(tmp_path / "mixed.gguf", up_type=up_type)
    monkeypatch.setattr(builtin, "smollm2_gguf", lambda: path)
    quant, ref = engine_for("builtin:smollm2-135m-moe"), engine_for("builtin:smollm2-135m-moe", dtype="float32")
    assert isinstance(quant.backend.parts.experts, QuantResidentExperts) == (up_type is None)
    assert quant.generate_ids(PROMPT, 8) == ref.generate_ids(PROMPT, 8)


def _requantised_builtin(tmp_path, ftype: str):
    """The built-in model's file requantised by llama.cpp's own quantiser (about a second)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from engine.models.builtin import smollm2_gguf

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    out = tmp_path / f"smollm2-{ftype}.gguf"
    assert llama_cpp.llama_model_quantize(str(smollm2_gguf()).encode(), str(out).encode(), params) == 0
    return out


def _check_real_file(path, expect_types: set[str]):
    quant, ref = engine_for(path), engine_for(path, dtype="float32")
    model = quant.backend.parts.model
    found = {m.qweight.qtype.name for m in model.modules() if isinstance(m, QuantLinear)}
    assert expect_types <= found, found
    prompt = quant.tokenize("The capital of France is")
    assert greedy_follows(quant, ref, prompt, 10)
    quant.close(), ref.close()


def test_llamacpp_q4_k_m_file_answers_as_dequantised(tmp_path):
    """SmolLM2's 576-wide matrices fall back to Q5_0 / Q8_0 (576 is not whole 256-blocks); its
    1536-wide down projections are Q4_K or Q6_K by layer, and v is Q8_0 beside Q5_0 q and k."""
    _check_real_file(_requantised_builtin(tmp_path, "Q4_K_M"), {"Q5_0", "Q8_0", "Q4_K", "Q6_K"})


@pytest.mark.slow
@pytest.mark.parametrize("ftype,types", [("Q5_K_M", {"Q5_1", "Q5_K", "Q6_K"}), ("Q6_K", {"Q8_0", "Q6_K"}),
                                         ("Q5_0", {"Q5_0"})])
def test_other_llamacpp_files_answer_as_dequantised(tmp_path, ftype, types):
    _check_real_file(_requantised_builtin(tmp_path, ftype), types)
