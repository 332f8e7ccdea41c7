"""Matrices a family re-lays at load while the loader keeps them in blocks: Qwen3.5's DeltaNet
projections (value heads re-grouped from llama.cpp's tiled order). Rows are re-laid in blocks (a row
selection), ssm_out's columns as floats; the model computes what the dequantised file's does.

Tolerance: as test_mixed_types_model.py, 1e-3 of the logits' scale for the int16 activation rounding.
"""

import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
    pytest.skip("this transformers has no qwen3_5_moe", allow_module_level=True)
llama_cpp = pytest.importorskip("llama_cpp")

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_mixed_types_model import engine_for, logits
from test_qwen3_5_moe import tiny
from test_qwen3_5_moe_gguf import write_qwen35_gguf

from engine.quant.modules import QuantLinear

PROMPT = [3, 17, 5, 42, 8, 9, 33, 60, 2, 71, 11, 4]


def test_qwen3_5_deltanet_rows_relaid_in_blocks(tmp_path):
    f32 = write_qwen35_gguf(tiny(seed=8), tmp_path / "f32.gguf")  # 4 value heads on 2 key heads
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, True
    q8 = tmp_path / "q8.gguf"  # the 32-wide matrices Q8_0 (16- and 24-wide ones fall back to F16)
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(q8).encode(), params) == 0
    quant, ref = engine_for(q8), engine_for(q8, dtype="float32")
    attn = quant.backend.parts.model.model.layers[0].linear_attn
    assert isinstance(attn.in_proj_qkv, QuantLinear) and isinstance(attn.in_proj_z, QuantLinear)
    assert isinstance(attn.in_proj_b, QuantLinear) and not isinstance(attn.out_proj, QuantLinear)
    for prefill in (len(PROMPT), 6):
        got, want = logits(quant, PROMPT, prefill), logits(ref, PROMPT, prefill)
        scale = float(want.abs().max())
        assert scale > 0.1 and float((got - want).abs().max()) <= 1e-3 * scale, float((got - want).abs().max())
    assert quant.generate_ids(PROMPT, 8) == ref.generate_ids(PROMPT, 8)
