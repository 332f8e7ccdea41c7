"""gpt-oss GGUF quantised by llama.cpp to MXFP4_MOE keeps its routed experts as MXFP4 blocks on the
CPU: `ffn_{gate,up,down}_exps` become `QuantStack`s of per-expert row views of the file, their biases
stay float beside them, and QuantResidentExperts computes the biased, clamped SwiGLU over the blocks.
The model follows the same file dequantised to float32 (the torch expert loop over fp32 weights).

Tolerance as test_quant_experts_gguf.py: every product over blocks rounds its activations to int16 per
32-block (at most 2^-16 of the block's largest value, ~1.5e-5 of Σ|w||x| per output); through two
layers of attention, two expert products in sequence and the head that compounds to some 1e-4 of the
logits' scale; held to 1e-3 of max |logit|. The clamp is piecewise linear, so a pre-activation within
that rounding of ±limit moves the output by no more than the rounding itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import stepped_logits as logits
from test_quant_experts_gguf import llama_quantise

from engine.api import Engine, EngineConfig
from engine.kernels.experts_torch import ClampedSwiGLU, moe_experts
from engine.models.loader import load_checkpoint
from engine.quant.blocks import QuantRows, QuantStack
from engine.quant.experts import QuantResidentExperts

llama_cpp = pytest.importorskip("llama_cpp")

VOCAB, H, I, E = 256, 64, 64, 8
PROMPT = [3, 17, 5, 42, 8, 9, 33, 60, 2, 71, 11, 4, 19, 23, 50, 64, 7, 88, 1]  # 19: prefill over tiles
MX = 39  # ggml's MXFP4


def write_mxfp4_gpt_oss(directory, tokenizer: tuple | None = None) -> str:
    """A random tiny gpt-oss (2 layers, 8 experts top 2, a 4-token window on layer 0) written as F32
    GGUF, then quantised by llama.cpp to MXFP4_MOE (experts MXFP4, other matrices Q8_0). Biases and
    sinks are drawn (the synthetic weights zero them) and gate_up is scaled by 8 so that many
    pre-activations pass the clamp at 7. `tokenizer`: the `tokenizer.*` fields to write (default: token
    strings alone, which Tandem runs on token ids and llama.cpp does not load)."""
    from gguf import GGUFValueType as T

    from engine.bench import gguf_export
    from engine.models import families, synthetic

    if tokenizer is None:
        tokenizer = (("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)], T.ARRAY, T.STRING),)
    name = "synthetic:gpt-oss-20b-L2"
    config = synthetic.config_for(name, vocab_size=gguf_export.tokenizer_vocab_size(tokenizer))
    config.update({"hidden_size": H, "intermediate_size": I, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 16, "num_local_experts": E, "num_experts_per_tok": 2, "sliding_window": 4,
                   "pad_token_id": None, "eos_token_id": None})
    args = families.get("gpt_oss").args_from_config(config)
    g = torch.Generator().manual_seed(5)

    def tensors():
        for n, t in synthetic.generate(name, config, device=torch.device("cpu"), dtype=torch.float32):
            if n.endswith(("bias", "sinks")):
                t = torch.randn(t.shape, generator=g) * 0.5
            elif n.endswith("experts.gate_up_proj"):
                t = t * 8.0
            yield n, t

    f32, out = directory / "gpt-oss-f32.gguf", directory / "gpt-oss-mxfp4.gguf"
    gguf_export.write_gguf(f32, family="gpt_oss", config=config, args=args, dtype="f32", tokenizer=tokenizer,
                           tensors=tensors())
    return llama_quantise(f32, out, "LLAMA_FTYPE_MOSTLY_MXFP4_MOE")


def file_expert_weight_bytes(path) -> int:
    """Bytes of the file's stacked expert matrices (`*_exps.weight`; their biases are model parameters)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if "_exps.weight" in t.name)


def engine_for(path, dtype="auto"):
    return Engine(EngineConfig(model=str(path), backend="tandem", device="cpu", max_batch=1, dtype=dtype))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_mxfp4_gpt_oss(tmp_path_factory.mktemp("gpt-oss-mxfp4"))


def test_loader_keeps_mxfp4_experts_as_row_views(path):
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "MXFP4" and types["blk.0.ffn_down_exps.weight"] == "MXFP4"
    kept = load_checkpoint(path, torch.float32, quantised=True).tensors
    plain = load_checkpoint(path, torch.float32).tensors
    for layer in range(2):
        p = f"model.layers.{layer}.mlp."
        gate_up, down = kept[p + "experts.gate_up_proj"], kept[p + "experts.down_proj"]
        assert isinstance(gate_up, QuantStack) and isinstance(down, QuantStack)
        assert gate_up.shape == (E, 2 * I, H) and down.shape == (E, H, I)
        assert gate_up.types() == ["MXFP4"] and down.types() == ["MXFP4"]
        assert all(isinstance(e, QuantRows) and len(e.parts) == 2 for e in gate_up.experts)
        starts = [t.blocks.data_ptr() for t in down.experts]  # expert e at rows [e·H, (e+1)·H) of the map
        assert starts == [starts[0] + e * down.experts[0].nbytes for e in range(E)]
        assert torch.equal(gate_up.dequantize(), plain[p + "experts.gate_up_proj"])
        assert torch.equal(down.dequantize(), plain[p + "experts.down_proj"])
        for bias in ("expert_gate_up_bias", "expert_down_bias"):  # float, gate half first, as dequantised
            assert isinstance(kept[p + bias], torch.Tensor) and torch.equal(kept[p + bias], plain[p + bias])


def test_model_over_mxfp4_experts_follows_the_dequantised_one(path, monkeypatch):
    quant, ref = engine_for(path), engine_for(path, dtype="float32")
    try:
        experts = quant.backend.parts.experts
        assert isinstance(experts, QuantResidentExperts) and sorted(experts.forms) == [0, 1]
        # host memory for the experts is the file's MXFP4 bytes: 17 bytes per 32 weights
        assert experts.nbytes() == file_expert_weight_bytes(path) == 2 * E * 3 * H * I // 32 * 17
        assert "MXFP4" in experts.telemetry()["kernel"] and "clamped" in experts.telemetry()["kernel"]
        largest = []
        activation = ClampedSwiGLU.activation
        monkeypatch.setattr(ClampedSwiGLU, "activation",
                            lambda self, g, u: largest.append(float(g.max())) or activation(self, g, u))
        for prefill in (len(PROMPT), 12):
            got, want = logits(quant, PROMPT, prefill), logits(ref, PROMPT, prefill)
            scale = float(want.abs().max())
            assert scale > 0.1 and float((got - want).abs().max()) <= 1e-3 * scale
        assert max(largest) > 7.0  # the clamp was in play
        monkeypatch.undo()
        assert quant.generate_ids(PROMPT, 8) == ref.generate_ids(PROMPT, 8)
    finally:
        quant.close()
        ref.close()


@pytest.mark.parametrize("n_tokens", [1, 3, 24])
def test_executor_form_matches_the_torch_loop(n_tokens):
    """Random MXFP4 stacks (gguf's quantiser) with biases: the executor against experts_torch's loop over
    the dequantised weights, at decode sizes (integer kernels) and a prefill chunk (dequantised tiles);
    tokens share experts and the top-k weights do not sum to one. Bound: the activation rounding above,
    ~1e-4 of the outputs' scale after two products."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    rng = np.random.default_rng(n_tokens)

    def stack(rows, cols, name):
        w = (rng.standard_normal((E * rows, cols)) * 4 / np.sqrt(cols)).astype(np.float32)
        return QuantStack.from_gguf(quantize(w, T.MXFP4).reshape(E, rows, -1), MX, name)

    gate, up, down = stack(I, H, "gate"), stack(I, H, "up"), stack(H, I, "down")
    gate_up = QuantStack.cat_rows(gate, up, "gate_up_proj")
    g = torch.Generator().manual_seed(n_tokens)
    form = ClampedSwiGLU(torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g))
    ex = QuantResidentExperts([gate_up], [down])
    ex.set_form(0, form)
    x = torch.randn(n_tokens, H, generator=g) * 2
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(n_tokens)])  # (N, 2)
    weights = torch.rand(n_tokens, 2, generator=g)
    got = ex.run(0, x, ids, weights)
    want = moe_experts(x, ids, weights, gate_up.dequantize(), down.dequantize(), form)
    assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())
    with pytest.raises(ValueError, match="do not fit"):
        ex.set_form(0, ClampedSwiGLU(torch.zeros(E, I), torch.zeros(E, H)))


def test_llamacpp_reads_the_same_file_alike(tmp_path):
    """llama.cpp on the same MXFP4_MOE file (with SmolLM2's tokenizer, which llama.cpp needs to load
    it) against Tandem's blocks, every position of one prefill. llama.cpp rounds each product's
    activations to int8 per 32-block (Q8_0: 2^-8 of the block's largest value, 258× Tandem's int16
    step), which compounds through the clamped experts to some 3% of max |logit| here; held to 5% and
    the same greedy token everywhere. A misread of the format is far outside it: the nibble halves
    swapped moves the logits by 1.5× their scale, the scale byte read one power of two off by 1×."""
    from engine.backends.llamacpp import amx_repack_off
    from engine.bench import gguf_export
    from engine.runtime.chat import tokenizer_fields

    path = write_mxfp4_gpt_oss(tmp_path, tokenizer_fields(gguf_export.default_tokenizer()))
    prompt = [1, 504, 3156, 314, 253, 2443, 30, 8049, 17, 49151, 9, 33]
    with amx_repack_off(llama_cpp):  # llama-cpp-python 0.3.36 crashes in decode on repacked weights on AMX CPUs
        llm = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=64, n_batch=64, n_threads=2, verbose=False,
                              type_k=0, type_v=0)  # F32 KV cache, as Tandem's
    try:
        llm.eval(prompt)
        theirs = torch.from_numpy(np.array(llm.scores[: len(prompt)], dtype=np.float32))
    finally:
        llm.close()
    quant = engine_for(path)
    try:
        assert isinstance(quant.backend.parts.experts, QuantResidentExperts)
        ours = logits(quant, prompt, len(prompt))
    finally:
        quant.close()
    scale = float(ours.abs().max())
    assert scale > 0.1 and float((ours - theirs).abs().max()) <= 0.05 * scale
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
