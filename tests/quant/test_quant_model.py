"""Models with weights kept in blocks: the GGUF loader's choice, the built-in models' answers, memory."""

import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.api import Engine, EngineConfig, GenerationRequest
from engine.models.assemble import place_tensor
from engine.models.loader import load_checkpoint
from engine.quant.blocks import QuantTensor
from engine.quant.experts import QuantResidentExperts
from engine.quant.modules import QuantEmbedding, QuantLinear

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SMALL = {"vocab": 96, "dim": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 96, "ctx": 128}  # whole blocks


def write_quantised_llama(path, types=(T.Q4_0, T.Q4_1, T.Q8_0), odd_type=None):
    """A 2-layer llama GGUF whose matrices cycle through `types` (odd_type: the first FFN down's)."""
    import gguf
    from gguf.quants import quantize

    c, rng = SMALL, np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c["layers"]); w.add_context_length(c["ctx"]); w.add_embedding_length(c["dim"])
    w.add_feed_forward_length(c["ffn"]); w.add_head_count(c["heads"]); w.add_head_count_kv(c["kv_heads"])
    w.add_rope_freq_base(10000.0); w.add_layer_norm_rms_eps(1e-5); w.add_vocab_size(c["vocab"])
    hd, n = c["dim"] // c["heads"], [0]

    def matrix(name, rows, cols, qtype=None):
        qtype = qtype or types[n[0] % len(types)]
        n[0] += 1
        if qtype == T.IQ4_NL:  # gguf-py has no IQ4_NL quantiser: random codes under an fp16 scale of 0.02
            data = rng.integers(0, 256, (rows, cols // 32, 18), dtype=np.uint8)
            data[:, :, :2] = np.full((rows, cols // 32), 0.02, np.float16)[..., None].view(np.uint8)
            data = data.reshape(rows, -1)
        else:
            data = quantize((rng.standard_normal((rows, cols)) * 0.2).astype(np.float32), qtype)
        w.add_tensor(name, data, raw_dtype=qtype)  # data: (rows, row bytes)

    matrix("token_embd.weight", c["vocab"], c["dim"])
    w.add_tensor("output_norm.weight", np.ones(c["dim"], np.float32))
    for i in range(c["layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(c["dim"], np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(c["dim"], np.float32))
        matrix(f"blk.{i}.attn_q.weight", c["heads"] * hd, c["dim"])
        matrix(f"blk.{i}.attn_k.weight", c["kv_heads"] * hd, c["dim"])
        matrix(f"blk.{i}.attn_v.weight", c["kv_heads"] * hd, c["dim"])
        matrix(f"blk.{i}.attn_output.weight", c["dim"], c["heads"] * hd)
        matrix(f"blk.{i}.ffn_gate.weight", c["ffn"], c["dim"])
        matrix(f"blk.{i}.ffn_up.weight", c["ffn"], c["dim"])
        matrix(f"blk.{i}.ffn_down.weight", c["dim"], c["ffn"], odd_type if i == 0 else None)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return path


def engine_for(path, **kw):
    return Engine(EngineConfig(model=str(path), backend="tandem", device="cpu", max_batch=1, **kw))


def test_loader_keeps_blocks_only_when_asked(tmp_path):
    path = write_quantised_llama(tmp_path / "q.gguf")
    kept = load_checkpoint(path, torch.float32, quantised=True).tensors
    plain = load_checkpoint(path, torch.float32).tensors
    assert isinstance(kept["model.layers.0.self_attn.q_proj.weight"], QuantTensor)
    assert isinstance(kept["model.embed_tokens.weight"], QuantTensor)
    assert not isinstance(kept["model.norm.weight"], QuantTensor)
    assert all(isinstance(t, torch.Tensor) for t in plain.values())
    for name, t in kept.items():  # the blocks hold the same weights, q/k rows un-permuted alike
        value = t.dequantize() if isinstance(t, QuantTensor) else t
        assert torch.equal(value, plain[name]), name


def test_quantised_tiny_model_follows_the_dequantised_one(tmp_path):
    path = write_quantised_llama(tmp_path / "q.gguf")
    quant, ref = engine_for(path), engine_for(path, dtype="float32")
    model = quant.backend.parts.model
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.blocks is model.model.embed_tokens.blocks  # tied: one block tensor
    assert isinstance(model.model.layers[1].mlp.down_proj, QuantLinear)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp  # one product each for q, k, v and gate, up
    assert attn.qkv_blocks.parts == [attn.q_proj.qweight, attn.k_proj.qweight, attn.v_proj.qweight]
    assert mlp.gate_up_blocks.parts == [mlp.gate_proj.qweight, mlp.up_proj.qweight]
    prompt = [3, 17, 5, 42, 8, 9, 33, 60, 2, 71]  # 10 tokens: the prefill path (dequantised tiles)
    assert quant.generate_ids(prompt, 12) == ref.generate_ids(prompt, 12)


def test_mxfp4_matrices_stay_blocks_and_follow_the_dequantised_model(tmp_path):
    path = write_quantised_llama(tmp_path / "q.gguf", types=(T.MXFP4, T.Q8_0))
    quant, ref = engine_for(path), engine_for(path, dtype="float32")
    layers = quant.backend.parts.model.model.layers
    assert {m.qweight.qtype.name for m in (layers[0].self_attn.q_proj, layers[0].self_attn.k_proj)} == {"MXFP4", "Q8_0"}
    prompt = [3, 17, 5, 42, 8, 9, 33, 60, 2, 71]
    assert quant.generate_ids(prompt, 12) == ref.generate_ids(prompt, 12)


def test_other_types_load_dequantised_with_a_message(tmp_path, caplog):
    path = write_quantised_llama(tmp_path / "q.gguf", odd_type=T.IQ4_NL)  # a type with no CPU kernel
    with caplog.at_level(logging.WARNING, logger="tandem.loader"):
        tensors = load_checkpoint(path, torch.float32, quantised=True).tensors
    assert not isinstance(tensors["model.layers.0.mlp.down_proj.weight"], QuantTensor)
    assert isinstance(tensors["model.layers.1.mlp.down_proj.weight"], QuantTensor)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "1 tensors of IQ4_NL dequantised to float32" in message and "MB in memory" in message
    assert len(engine_for(path).generate_ids([1, 2, 3], 4)) == 4


def test_blocks_are_dequantised_where_no_kernel_takes_them():
    """Off the CPU and not on CUDA (where engine/kernels/quant_linear_gpu.py reads them) blocks dequantise."""
    from gguf.quants import quantize

    data = quantize(np.ones((4, 32), np.float32), T.Q8_0)
    placed = place_tensor(QuantTensor.from_gguf(data, int(T.Q8_0), "w"), torch.device("meta"), torch.bfloat16)
    assert isinstance(placed, torch.Tensor) and placed.dtype == torch.bfloat16 and placed.shape == (4, 32)


@pytest.mark.parametrize("model", ["builtin:smollm2-135m", "builtin:smollm2-135m-moe"])
def test_builtin_models_answer_from_blocks(model):
    engine = Engine(EngineConfig(model=model, backend="tandem", device="cpu"))
    parts = engine.backend.parts
    assert isinstance(parts.model.model.layers[0].self_attn.q_proj, QuantLinear)
    assert "Q4_1" in engine.info()["weight_types"]  # what the app and the stats say the weights are held in
    if parts.experts is not None:
        assert isinstance(parts.experts, QuantResidentExperts)
        assert parts.experts.telemetry()["bytes"] < 3 * 30 * 553_000  # one copy of gate_up, down per layer
    result = engine.generate(GenerationRequest(messages=QUESTION, max_new_tokens=12, greedy=True))
    assert result.text.startswith("The capital of France is Paris")
    engine.close()


def test_builtin_host_memory_near_its_file_size():
    """RSS grown by loading the built-in model (fresh process): the 98 MB file, not 540 MB of fp32."""
    from engine.models.builtin import smollm2_gguf

    code = ("import json, psutil, torch; from engine.api import Engine, EngineConfig; p = psutil.Process();"
            " before = p.memory_info().rss;"
            " e = Engine(EngineConfig(model='builtin:smollm2-135m', backend='tandem', device='cpu', max_context=512));"
            " print(json.dumps(p.memory_info().rss - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grown = json.loads(out.stdout.strip().splitlines()[-1])
    file_size = smollm2_gguf().stat().st_size
    assert grown < 2 * file_size + 100e6, f"RSS grew {grown / 1e6:.0f} MB for a {file_size / 1e6:.0f} MB file"
