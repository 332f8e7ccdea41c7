"""A MoE GGUF quantised by llama.cpp keeps its routed experts in blocks on the CPU: each layer's
`ffn_{gate,up,down}_exps` become `QuantStack`s of per-expert row views of the file (no copy), run by
QuantResidentExperts, and the model computes what the same file dequantised to float32 does.

Logit tolerance, as in test_mixed_types_model.py: every product over blocks rounds its activations to
int16 per 32-block (at most 2^-16 of the block's largest value, about 1.5e-5 of Σ|w||x| per output);
through two layers of attention, two expert products in sequence and the head that compounds to some
1e-4 of the logits' scale; held to 1e-3 of max |logit| (4e-2 where AVX2's K-quant products read
int8 activations: helpers.quant_logit_tolerance says why; greedy_follows for the generations). Prefill of more
than 16 tokens runs dense products as dequantised tiles (exact up to summation order), experts of few
pairs and the decode steps the integer kernels.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import greedy_follows, quant_logit_tolerance
from helpers import stepped_logits as logits

from engine.api import Engine, EngineConfig
from engine.models.loader import (
    EXPERT_BLOCK_FAMILIES,
    keeps_expert_blocks,
    load_checkpoint,
)
from engine.quant.blocks import QuantRows, QuantStack, QuantTensor

llama_cpp = pytest.importorskip("llama_cpp")

# K-quants need rows that are whole 256-weight super-blocks, else llama.cpp falls back to other types:
# hidden 256 and expert FFN 256 (o_proj reads 4 heads × 64 = 256).
DIMS = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2}
PRESETS = {"qwen3_moe": "qwen3-30b-a3b", "olmoe": "olmoe-1b-7b", "mixtral": "mixtral-8x7b"}
# Mixtral sizes its experts by intermediate_size and counts them as num_local_experts
OWN_DIMS = {"mixtral": {"intermediate_size": 256, "num_local_experts": 8}}
PROMPT = [3, 17, 5, 42, 8, 9, 33, 60, 2, 71, 11, 4, 19, 23, 50, 64, 7, 88, 1]  # 19: prefill over tiles
MODELS = [("qwen3_moe", "Q8_0"), ("qwen3_moe", "Q4_K_M"), ("olmoe", "Q4_K_M"), ("mixtral", "Q4_K_M")]
FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def write_quantised(directory, family: str, ftype: str, layers: int = 2, vocab: int = 256, **dims) -> str:
    """A random tiny `family` model written as F32 GGUF, then quantised by llama.cpp to `ftype`."""
    from engine.bench import gguf_export
    from engine.models import families, synthetic

    name = f"synthetic:{PRESETS[family]}-L{layers}"
    config = synthetic.config_for(name, vocab_size=vocab)
    config.update({**DIMS, **OWN_DIMS.get(family, {}), **dims})
    args = families.get(family).args_from_config(config)
    f32, out = directory / f"{family}-f32.gguf", directory / f"{family}-{ftype}.gguf"
    # token strings without a tokenizer model: Tandem runs the file on token ids, without a tokenizer
    tokenizer = (("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)], *_array()),)
    gguf_export.write_gguf(f32, family=family, config=config, args=args, dtype="f32", tokenizer=tokenizer,
                           tensors=synthetic.generate(name, config, device=torch.device("cpu"), dtype=torch.float32))
    return llama_quantise(f32, out, FTYPES[ftype])


def llama_quantise(f32, out, ftype: str) -> str:
    """llama.cpp's own quantiser (ftype: a llama_cpp LLAMA_FTYPE_* name) from f32 to out; f32 removed."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.allow_requantize = True
    params.nthread = 1
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantise {f32} to {ftype}")
    f32.unlink()
    return str(out)


def _array():
    from gguf import GGUFValueType as T

    return T.ARRAY, T.STRING


def file_expert_bytes(path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if "_exps" in t.name)


def engine_for(path, dtype="auto", **kw):
    return Engine(EngineConfig(model=str(path), backend="tandem", device="cpu", max_batch=1, dtype=dtype, **kw))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe-gguf")
    return {key: write_quantised(d, *key) for key in MODELS}


def test_loader_keeps_experts_as_row_views_of_the_file(files, caplog):
    path = files[("qwen3_moe", "Q4_K_M")]
    with caplog.at_level(logging.WARNING, logger="tandem.loader"):
        kept = load_checkpoint(path, torch.float32, quantised=True).tensors
    assert not [r for r in caplog.records if "experts" in r.getMessage()]
    plain = load_checkpoint(path, torch.float32).tensors
    types = set()
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up, down = kept[p + "gate_up_proj"], kept[p + "down_proj"]
        assert isinstance(gate_up, QuantStack) and isinstance(down, QuantStack)
        assert gate_up.shape == (8, 512, 256) and down.shape == (8, 256, 256)
        assert all(isinstance(e, QuantRows) and len(e.parts) == 2 for e in gate_up.experts)
        # every expert of one file tensor views one storage: rows [e·N, (e+1)·N), nothing copied
        for stack in ([e.parts[0] for e in gate_up.experts], [e.parts[1] for e in gate_up.experts], down.experts):
            assert len({t.blocks.untyped_storage().data_ptr() for t in stack}) == 1
            starts = [t.blocks.data_ptr() for t in stack]
            assert starts == [starts[0] + e * stack[0].nbytes for e in range(8)]
        types |= set(gate_up.types()) | set(down.types())
        assert torch.equal(gate_up.dequantize(), plain[p + "gate_up_proj"])  # gate rows first, as dequantised
        assert torch.equal(down.dequantize(), plain[p + "down_proj"])
    assert "Q4_K" in types and types <= {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0"}


@pytest.mark.parametrize("key", MODELS, ids=lambda k: "-".join(k))
def test_model_over_expert_blocks_follows_the_dequantised_one(files, key):
    from engine.quant.experts import QuantResidentExperts

    path = files[key]
    quant, ref = engine_for(path), engine_for(path, dtype="float32")
    try:
        experts = quant.backend.parts.experts
        assert isinstance(experts, QuantResidentExperts)
        assert all(isinstance(s, QuantStack) for s in (*experts.gate_up, *experts.down))
        # host memory for the experts is the file's expert bytes; dequantised they take 3.5× (Q8_0) or more
        assert experts.nbytes() == file_expert_bytes(path)
        float_bytes = ref.backend.parts.experts.nbytes()
        assert float_bytes == 2 * 8 * 3 * 256 * 256 * 4 and float_bytes >= 3.5 * experts.nbytes()
        for prefill in (len(PROMPT), 12):
            got, want = logits(quant, PROMPT, prefill), logits(ref, PROMPT, prefill)
            scale = float(want.abs().max())
            assert scale > 0.1 and float((got - want).abs().max()) <= quant_logit_tolerance() * scale
        assert greedy_follows(quant, ref, PROMPT, 8)
        assert "Q" in experts.telemetry()["kernel"]
        assert quant.stats().to_dict()["kernels"]["cpu_experts"] == experts.telemetry()["kernel"]  # the panel's
    finally:
        quant.close()
        ref.close()


def test_offloading_with_an_explicit_dtype_dequantises(files):
    """An offload policy with dtype float32 (the reference path) stores the experts dequantised; with
    dtype auto it keeps their blocks (test_quant_expert_store.py)."""
    from engine.experts.offload import OffloadedExperts

    path = files[("qwen3_moe", "Q8_0")]
    eng = engine_for(path, dtype="float32", expert_policy="cpu-only", simulate_hybrid=True)
    try:
        experts = eng.backend.parts.experts
        assert isinstance(experts, OffloadedExperts) and experts.store.blocks.dtype == torch.float32
        assert len(eng.generate_ids(PROMPT, 4)) == 4
    finally:
        eng.close()


def test_decision_by_family_and_plan():
    assert all(keeps_expert_blocks(family, True) for family in ("qwen3_moe", "olmoe", "mixtral", "gpt_oss",
                                                                "qwen3_5_moe", "glm4_moe", "deepseek_v2"))
    assert "llama" not in EXPERT_BLOCK_FAMILIES and not keeps_expert_blocks("llama", True)  # no routed experts
    assert not keeps_expert_blocks("qwen3_moe", False)  # an explicit dtype


def test_experts_of_mixed_kinds_are_all_dequantised(caplog):
    """One executor runs every layer: a float expert tensor beside blocks (a type outside the kernels'
    set) makes the loader dequantise the blocks too rather than hand the executor both kinds."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    from engine.models import loader

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((2 * 4, 64)) * 0.05).astype(np.float32)
    q = quantize(w, T.Q8_0).reshape(2, 4, -1)  # (E, N, row bytes)
    stack = QuantStack.from_gguf(q, int(T.Q8_0), "blk.0.ffn_gate_exps.weight")
    assert isinstance(stack.experts[1], QuantTensor) and stack.experts[1].blocks.data_ptr() - \
        stack.experts[0].blocks.data_ptr() == 4 * q.shape[2]
    raw = {"blk.0.ffn_gate_exps.weight": stack, "blk.0.ffn_up_exps.weight": stack,
           "blk.0.ffn_down_exps.weight": torch.zeros(2, 64, 4)}
    with caplog.at_level(logging.WARNING, logger="tandem.loader"):
        loader._experts_all_blocks_or_none(raw, torch.float32)
    assert all(isinstance(t, torch.Tensor) for t in raw.values()) and "mixed kinds" in caplog.text
    want = torch.from_numpy(w).reshape(2, 4, 64)
    assert torch.allclose(raw["blk.0.ffn_gate_exps.weight"], want, atol=0.05 / 127 * 4)
