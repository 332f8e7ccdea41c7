"""GGUF export: a tiny Qwen3-MoE written by Tandem is read back by Tandem's own loader and run by
llama.cpp (llama-cpp-python, CPU) with the logits of the original model: both engines run the same
weights."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from engine.api import Engine, EngineConfig
from engine.bench import gguf_export
from engine.errors import ConfigError, UnsupportedModelError

VOCAB = 49152  # the borrowed SmolLM2 tokenizer's size: llama.cpp needs the model's vocabulary to equal it
PROMPT = [1, 504, 3156, 314, 253, 2443, 30, 8049, 17, 49151, 9, 33]


def _tiny_folder(path, **overrides):
    """A random transformers Qwen3-MoE (3 layers, 8 experts top 2) saved as a model folder."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
               rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.update(overrides)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).eval().save_pretrained(path)
    return path


def _small_tokenizer(n: int) -> tuple:
    """tokenizer.* keys of an n-token vocabulary (token strings only): enough for files that only
    Tandem's loader reads, which takes seconds less than SmolLM2's 49152 tokens and merges."""
    from gguf import GGUFValueType as T

    return (("tokenizer.ggml.model", "gpt2", T.STRING, None),
            ("tokenizer.ggml.tokens", [f"t{i}" for i in range(n)], T.ARRAY, T.STRING))


@torch.inference_mode()
def tandem_logits(model: str, ids=PROMPT) -> torch.Tensor:
    """(T, V) fp32 logits of every prompt position, one prefill step."""
    engine = Engine(EngineConfig(model=str(model), backend="tandem", device="cpu", dtype="float32", max_batch=1,
                                 max_context=64))
    try:
        p, kv = engine.parts, engine.parts.kv
        sid = kv.new_sequence()
        positions = kv.begin_step([sid], len(ids))
        out = p.model(torch.tensor([ids]), positions, kv, last_only=False)[0].float()
        kv.end_step()
        kv.free(sid)
        return out
    finally:
        engine.close()


def llamacpp_logits(path, ids=PROMPT) -> torch.Tensor:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=64, n_batch=64, n_threads=2, verbose=False,
                          type_k=0, type_v=0)  # F32 KV cache (the default F16 one rounds K and V)
    try:
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    finally:
        llm.close()


def check_synthetic_bf16_export(name: str, out, arch: str, layers: int, atol: float = 0.1) -> None:
    """The bench's path: `name` (a synthetic preset) exported in BF16 holds exactly the weights Tandem
    draws for it, and llama.cpp on that file gives Tandem's logits on it within bf16 activation
    rounding (llama.cpp's matmuls round activations to bf16): 0.1 absolute on logits of RMS near 1,
    every greedy token equal."""
    from engine.models import synthetic
    from engine.models.loader import load_checkpoint

    stats = gguf_export.export(name, out)
    assert stats["arch"] == arch and stats["layers"] == layers and stats["dtype"] == "bf16"
    want = synthetic.load(name, device=torch.device("cpu"), vocab_size=VOCAB).tensors
    got = load_checkpoint(out, torch.bfloat16).tensors
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    tandem = tandem_logits(out)
    ours = llamacpp_logits(out)
    assert tandem.std() > 0.3
    torch.testing.assert_close(ours, tandem, atol=atol, rtol=0)
    assert (ours.argmax(-1) == tandem.argmax(-1)).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    folder = _tiny_folder(d / "m")
    f32 = d / "tiny-f32.gguf"
    bf16 = d / "tiny-bf16.gguf"
    stats = gguf_export.export(str(folder), f32, dtype="f32")
    gguf_export.export(str(folder), bf16, dtype="bf16")
    return {"folder": folder, "f32": f32, "bf16": bf16, "stats": stats, "ref": tandem_logits(folder)}


def test_file_has_llamacpp_names_metadata_and_types(tiny):
    import gguf

    r = gguf.GGUFReader(tiny["bf16"])
    tensors = {t.name: t for t in r.tensors}
    assert tensors["blk.0.ffn_gate_exps.weight"].shape.tolist() == [64, 32, 8]  # GGUF dims: {H, I, E}
    assert tensors["blk.0.ffn_down_exps.weight"].shape.tolist() == [32, 64, 8]
    assert tensors["token_embd.weight"].shape.tolist() == [64, VOCAB]
    assert tensors["blk.2.attn_q_norm.weight"].shape.tolist() == [16]
    assert tensors["blk.1.attn_q.weight"].tensor_type.name == "BF16"
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type.name == "F32"  # routers stay F32, as llama.cpp converts
    assert tensors["blk.1.attn_norm.weight"].tensor_type.name == "F32"
    assert len(tensors) == 3 + 3 * 12
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert meta["general.architecture"] == "qwen3moe"
    assert (meta["qwen3moe.expert_count"], meta["qwen3moe.expert_used_count"]) == (8, 2)
    assert meta["qwen3moe.expert_feed_forward_length"] == 32 and meta["qwen3moe.attention.key_length"] == 16
    assert meta["qwen3moe.rope.dimension_count"] == 16 and meta["qwen3moe.attention.head_count_kv"] == 2
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == VOCAB
    assert tiny["stats"]["tensors"] == len(tensors) and tiny["stats"]["bytes"] == tiny["f32"].stat().st_size


def test_tandem_reads_the_f32_export_exactly(tiny):
    """The writer is the inverse of the reader: the same logits (observed bit-identical)."""
    torch.testing.assert_close(tandem_logits(tiny["f32"]), tiny["ref"], atol=1e-5, rtol=0)


def test_llamacpp_runs_the_same_weights_f32(tiny):
    """llama.cpp (CPU, fp32 math) on the F32 file gives the original model's logits.
    With an F32 KV cache: 1e-4 absolute on logits of RMS 1.6 (max 7.6): fp32 in another summation
    order (observed 7e-6); a wrong name, permutation or expert order moves logits by O(1)."""
    ref = tiny["ref"]
    assert ref.abs().max() > 1.0 and ref.std() > 0.3  # not degenerate
    ours = llamacpp_logits(tiny["f32"])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_llamacpp_runs_the_same_weights_bf16(tiny):
    """BF16 file: Tandem (fp32 math on the bf16-rounded weights) and llama.cpp agree within bf16
    activation rounding (llama.cpp's CPU matmuls round activations to bf16 against bf16 weights):
    observed 0.05 on logits of RMS 1.6; allowed 0.1, while the bf16 weight rounding alone moves
    them from the fp32 original by about as much (0.05) — both far below the O(1) of a layout error."""
    tandem = tandem_logits(tiny["bf16"])
    ours = llamacpp_logits(tiny["bf16"])
    torch.testing.assert_close(ours, tandem, atol=0.1, rtol=0)
    cos = torch.nn.functional.cosine_similarity(ours, tiny["ref"], dim=-1)
    assert cos.min() > 0.999


def test_streaming_synthetic_export_matches_the_synthetic_model(tmp_path, monkeypatch):
    """A synthetic preset's export holds exactly the weights Tandem draws for it (bf16, same seed,
    the tokenizer's vocabulary), read back by Tandem's loader; the -L<n> suffix cuts layers."""
    from engine.models import synthetic
    from engine.models.loader import load_checkpoint

    tiny_preset = dict(synthetic.PRESETS["olmoe-1b-7b"], hidden_size=64, intermediate_size=32,
                       num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-olmoe", tiny_preset)
    name = "synthetic:tiny-olmoe-L2"
    out = tmp_path / "o.gguf"
    seen = []
    stats = gguf_export.export(name, out, progress=lambda step, frac: seen.append(frac))
    assert stats["arch"] == "olmoe" and stats["vocab_size"] == VOCAB and stats["layers"] == 2
    assert seen[-1] == pytest.approx(1.0) and seen == sorted(seen)
    want = synthetic.load(name, device=torch.device("cpu"), vocab_size=VOCAB).tensors
    got = load_checkpoint(out, torch.bfloat16).tensors
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert want["model.embed_tokens.weight"].shape == (VOCAB, 64)  # the preset's own is 50304 tokens
    assert synthetic.config_for(name)["vocab_size"] == 50304


def test_mixtral_rows_are_permuted_for_llamas_rope(tmp_path):
    """Mixtral goes out as arch `llama` with q/k rows in llama.cpp's interleaved order; Tandem's
    reader undoes it, so the round trip is exact."""
    import gguf

    from engine.models import synthetic
    from engine.models.loader import load_checkpoint

    config = synthetic.config_for("synthetic:mixtral-8x7b-L1", vocab_size=256)
    config.update(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2)
    from engine.models import mixtral

    args = mixtral.args_from_config(config)
    tensors = dict(synthetic.generate("synthetic:mixtral-8x7b-L1", config, device=torch.device("cpu")))
    out = tmp_path / "x.gguf"
    gguf_export.write_gguf(out, family="mixtral", config=config, args=args, tensors=iter(tensors.items()),
                           tokenizer=_small_tokenizer(256))
    r = gguf.GGUFReader(out)
    assert r.fields["general.architecture"].contents() == "llama"
    q = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight")
    stored = torch.from_numpy(np.array(q.data).view(np.int16).copy()).view(torch.bfloat16).reshape(64, 64)
    assert not torch.equal(stored, tensors["model.layers.0.self_attn.q_proj.weight"])  # permuted on disk
    back = load_checkpoint(out, torch.bfloat16)
    assert back.family == "mixtral"
    for k, v in tensors.items():
        assert torch.equal(back.tensors[k], v), k


def test_refusals(tmp_path):
    folder = _tiny_folder(tmp_path / "m", vocab_size=96)
    with pytest.raises(ConfigError, match="49152"):  # no tokenizer of that size to borrow
        gguf_export.export(str(folder), tmp_path / "a.gguf")
    assert not list(tmp_path.glob("a.gguf*"))
    folder = _tiny_folder(tmp_path / "n", norm_topk_prob=False)
    with pytest.raises(UnsupportedModelError, match="renormalises"):  # llama.cpp's qwen3moe always does
        gguf_export.export(str(folder), tmp_path / "b.gguf")
    with pytest.raises(ConfigError):
        gguf_export.export(str(folder), tmp_path / "c.gguf", dtype="q4")


def test_cli(tiny, tmp_path, capsys):
    from engine.cli import main

    out = tmp_path / "c.gguf"
    assert main(["export-gguf", "--model", str(tiny["folder"]), "--out", str(out), "--quiet"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["bytes"] == out.stat().st_size == tiny["bf16"].stat().st_size and record["arch"] == "qwen3moe"


def _tiny_gpt_oss(path, rope: dict):
    """A random transformers gpt-oss (4 layers, even ones sliding over 4 tokens, 8 experts top 2) with
    biases and sinks drawn (transformers zeroes them) and expert pre-activations past the clamp."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
               max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False, rope_parameters=rope,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**cfg)).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(100)
        for name, t in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            if name.endswith("experts.gate_up_proj"):
                t.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_gpt_oss_export_runs_the_same_model_in_llamacpp(tmp_path, rope):
    """gpt-oss's sinks, windows, biases and clamped SwiGLU reach llama.cpp: its logits on the F32
    export equal Tandem's on the folder (same 1e-4 as the Qwen3-MoE test above). llama.cpp's YaRN
    rounds the correction range to whole dimensions, i.e. transformers' `truncate: True`; published
    gpt-oss configs say False (Tandem follows them, and reads gpt-oss GGUFs so), so the YaRN case is
    built with True to compare the same arithmetic."""
    params = {"rope_type": "default", "rope_theta": 10000.0} if rope == "default" else {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": True, "original_max_position_embeddings": 64}
    folder = _tiny_gpt_oss(tmp_path / "m", params)
    out = tmp_path / "gpt-oss-f32.gguf"
    gguf_export.export(str(folder), out, dtype="f32")
    ref = tandem_logits(folder)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(llamacpp_logits(out), ref, atol=1e-4, rtol=0)
    # Tandem loads its own export: with YaRN keys transformers' AutoTokenizer fails on the file (5.24)
    # and the tokenizer is read alone; back exactly without YaRN (with it, Tandem's is untruncated)
    back = tandem_logits(out)
    if rope == "default":
        torch.testing.assert_close(back, ref, atol=1e-5, rtol=0)
    else:
        assert torch.isfinite(back).all()


def test_gpt_oss_with_another_swiglu_is_refused(tmp_path):
    import json as _json

    folder = _tiny_gpt_oss(tmp_path / "m", {"rope_type": "default", "rope_theta": 10000.0})
    cfg = _json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(_json.dumps({**cfg, "swiglu_limit": 5.0}))
    with pytest.raises(UnsupportedModelError, match="alpha and limit"):
        gguf_export.export(str(folder), tmp_path / "x.gguf", dtype="f32")


def test_a_quantised_synthetic_preset_exports_its_blocks(tmp_path, monkeypatch):
    """`synthetic:…-Q4_0` writes its experts' Q4_0 blocks as they are (the file is what the preset
    holds, not a re-quantisation), everything else as the BF16 export; Tandem's loader reads the
    blocks back byte for byte, and llama.cpp on the file follows Tandem's logits on it within what
    its Q8_0 activations add (cosine ≥ 0.99, against O(1) moves for a wrong layout)."""
    from engine.models import synthetic
    from engine.models.loader import load_checkpoint
    from engine.quant.blocks import QuantStack

    tiny_preset = dict(synthetic.PRESETS["qwen3-30b-a3b"], hidden_size=64, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, num_hidden_layers=2)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-qwen3", tiny_preset)
    name, out = "synthetic:tiny-qwen3-Q4_0", tmp_path / "q.gguf"
    stats = gguf_export.export(name, out)
    bf16 = gguf_export.export("synthetic:tiny-qwen3", tmp_path / "b.gguf")
    assert stats["bytes"] < bf16["bytes"]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert {v for k, v in types.items() if "_exps" in k} == {"Q4_0"} and types["blk.0.attn_q.weight"] == "BF16"
    want = synthetic.load(name, device=torch.device("cpu"), vocab_size=VOCAB).tensors
    got = load_checkpoint(out, torch.bfloat16, expert_blocks=True).tensors
    assert set(got) == set(want)
    for k, w in want.items():
        if isinstance(w, QuantStack):
            assert isinstance(got[k], QuantStack)
            for a, b in zip(got[k].experts, w.experts):
                assert torch.equal(a.dequantize(torch.float32), b.dequantize(torch.float32)), k
        else:
            assert torch.equal(got[k], w), k
    tandem = tandem_logits(out)
    ours = llamacpp_logits(out)
    assert tandem.std() > 0.3
    assert torch.nn.functional.cosine_similarity(ours, tandem, dim=-1).min() > 0.99


def test_a_dense_llama_preset_exports_for_llamacpp(tmp_path, monkeypatch):
    """A dense preset (`synthetic:llama-3.2-1b`'s family at tiny widths, tied embeddings, GQA) exports in
    BF16 as llama.cpp's llama architecture: the same weights, and llama.cpp's logits follow Tandem's
    within bf16 activation rounding. The head is the unit-RMS embedding, so logits have RMS 8, not 1:
    0.2 absolute (2.5% of it; observed 0.16), every greedy token equal."""
    from engine.models import synthetic

    tiny = dict(synthetic.PRESETS["llama-3.2-1b"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_hidden_layers=2)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-llama", tiny)
    check_synthetic_bf16_export("synthetic:tiny-llama", tmp_path / "d.gguf", "llama", 2, atol=0.2)
