"""GGUF files in blocks end to end, made without llama.cpp (gguf-py quantises: gguf_requantise.py), so
that the GPU machine runs these with `-m cuda`: a Qwen3-MoE with Q4_0/Q4_1/Q8_0 experts and Q8_0 dense
matrices, and a gpt-oss with MXFP4 experts, each loaded on CUDA (dtype auto: dense layers and experts
in blocks there; resident, in cache slots, and adaptive's one-graph decode) against the same file
dequantised to float32 on the CPU. Here (no GPU) the files themselves are checked on the CPU engine.

Tolerance on the GPU: bf16 activations and dense tiles through the layers, 3% of the logits' scale, in
every position but one. bf16 rounding can flip a near-tie of the router (random weights, top-2 of 8),
and a position routed to another expert is off by far more: on an H100 the Qwen file's 19 positions
were within 2.7% in bf16 through its blocks, but one at 12%; the same model's float32 file run in bf16
with no blocks at all had one at 21%.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_requantise import requantise
from helpers import stepped_logits as logits

from engine.api import Engine, EngineConfig

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPT = [3, 17, 5, 42, 8, 9, 33, 60, 2, 71, 11, 4, 19, 23, 50, 64, 7, 88, 1]  # 19: prefill past 8 tokens
H, I, E = 256, 256, 8


def export_f32(directory, family: str, preset: str, **dims) -> str:
    """A random tiny `preset` (2 layers) written as an F32 GGUF by the engine's exporter."""
    from gguf import GGUFValueType as V

    from engine.bench import gguf_export
    from engine.models import families, synthetic

    name = f"synthetic:{preset}-L2"
    tokenizer = (("tokenizer.ggml.tokens", [f"t{i}" for i in range(128)], V.ARRAY, V.STRING),)
    config = synthetic.config_for(name, vocab_size=128)
    config.update(dims)
    args = families.get(family).args_from_config(config)
    g = torch.Generator().manual_seed(5)

    def tensors():
        for n, t in synthetic.generate(name, config, device=torch.device("cpu"), dtype=torch.float32):
            if n.endswith(("bias", "sinks")):
                t = torch.randn(t.shape, generator=g) * 0.5  # the synthetic weights zero them
            yield n, t

    out = directory / f"{family}-f32.gguf"
    gguf_export.write_gguf(out, family=family, config=config, args=args, dtype="f32", tokenizer=tokenizer,
                           tensors=tensors())
    return out


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen-blocks")
    src = export_f32(d, "qwen3_moe", "qwen3-30b-a3b", hidden_size=H, moe_intermediate_size=I, num_experts=E,
                     num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return requantise(src, d / "qwen-q.gguf", {"gate": T.Q4_0, "up": T.Q4_1, "down": T.Q8_0}, T.Q8_0)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt-oss-blocks")
    src = export_f32(d, "gpt_oss", "gpt-oss-20b", hidden_size=H, intermediate_size=I, num_local_experts=E,
                     num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     sliding_window=4, pad_token_id=None, eos_token_id=None)
    return requantise(src, d / "gpt-oss-mxfp4.gguf", {"gate_up": T.MXFP4, "gate": T.MXFP4, "up": T.MXFP4,
                                                      "down": T.MXFP4}, T.Q8_0)


def engine(path, device: str, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), backend="tandem", device=device, max_batch=1, **kw))


def against_the_dequantised_file(path, tolerance: float, check=lambda parts: None, **kw) -> None:
    ref = engine(path, "cpu", dtype="float32")
    got_engine = engine(path, "cuda" if torch.cuda.is_available() else "cpu", **kw)
    try:
        check(got_engine.backend.parts)
        got, want = logits(got_engine, PROMPT, len(PROMPT)), logits(ref, PROMPT, len(PROMPT))  # (T, V)
        scale = float(want.abs().max())
        worst = (got.float() - want).abs().amax(1).sort().values  # (T,) each position's largest error
        assert scale > 0.1 and float(worst[-2]) <= tolerance * scale, worst  # one flipped route allowed
        assert len(got_engine.generate_ids(PROMPT, 6)) == 6  # decode steps after the prefill (graphs on CUDA)
    finally:
        got_engine.close()
        ref.close()


@pytest.mark.parametrize("which", ["qwen", "gpt_oss"])
def test_the_requantised_files_keep_their_blocks_on_the_cpu(which, request):
    """The files as made: blocks of the asked types, and the CPU engine over them follows the same file
    dequantised (int16-rounded activations: 1e-3 of the logits' scale, as the CPU's block tests)."""
    import gguf

    from engine.quant.modules import QuantLinear

    path = request.getfixturevalue(which)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    if which == "qwen":
        assert types["blk.0.ffn_gate_exps.weight"] == "Q4_0" and types["blk.0.ffn_down_exps.weight"] == "Q8_0"
    else:
        assert types["blk.0.ffn_down_exps.weight"] == "MXFP4"
    assert types["blk.0.attn_q.weight"] == "Q8_0"
    ref, quant = engine(path, "cpu", dtype="float32"), engine(path, "cpu")
    try:
        assert isinstance(quant.backend.parts.model.model.layers[0].self_attn.q_proj, QuantLinear)
        got, want = logits(quant, PROMPT, len(PROMPT)), logits(ref, PROMPT, len(PROMPT))
        assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())
    finally:
        quant.close()
        ref.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("which", ["qwen", "gpt_oss"])
@pytest.mark.parametrize("placement", [{"expert_policy": "resident"},
                                       {"expert_policy": "on-demand", "expert_cache_slots": 5},
                                       {"expert_policy": "adaptive", "expert_cache_slots": 5}],
                         ids=["resident", "slots", "adaptive"])
def test_blocks_on_the_gpu_follow_the_dequantised_file(which, placement, request):
    from engine.quant.modules import QuantLinear

    def check(parts):
        attn = parts.model.model.layers[0].self_attn
        q_proj = attn.q_proj
        assert isinstance(q_proj, QuantLinear) and q_proj.qweight.blocks.is_cuda  # dense blocks on the GPU
        # q, k and v (all Q8_0) stacked as one matrix, the projections' weights views of it
        rows = attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features
        assert attn.qkv_blocks.shape == (rows, q_proj.in_features)
        assert attn.v_proj.qweight.blocks.data_ptr() == attn.qkv_blocks.blocks[-attn.v_proj.out_features:].data_ptr()
        if placement["expert_policy"] == "resident":
            from engine.experts.gpu_quant_resident import GpuQuantResidentExperts

            assert isinstance(parts.experts, GpuQuantResidentExperts)
        else:
            assert parts.experts.store.quantised and parts.experts.cache.pool.dtype == torch.uint8

    against_the_dequantised_file(request.getfixturevalue(which), 3e-2, check, **placement)
