"""Loading real files: tiny GGUF and safetensors models, and each bad-input case's clear error."""


import gguf
import numpy as np
import pytest
import torch

from engine.api import Engine, EngineConfig
from engine.errors import ConfigError, ModelFileError, UnsupportedModelError
from engine.models.loader import load_checkpoint
from helpers import TINY, write_tiny_llama_folder, write_tiny_llama_gguf


def tiny_engine(path, **kw):
    return Engine(EngineConfig(model=str(path), backend="tandem", device="cpu", max_batch=2, **kw))


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ModelFileError, match="not found.*nope.gguf"):
        load_checkpoint(tmp_path / "nope.gguf")


def test_truncated_gguf(tmp_path):
    good = write_tiny_llama_gguf(tmp_path / "good.gguf")
    data = good.read_bytes()
    for cut in (len(data) // 2, 200, 20):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFileError) as e:
            load_checkpoint(bad)
        assert str(bad) in e.value.what and ("truncated" in str(e.value) or "again" in e.value.remedy)


def test_unknown_architecture(tmp_path):
    path = write_tiny_llama_gguf(tmp_path / "m.gguf", arch="mamba9")
    with pytest.raises(UnsupportedModelError, match="mamba9"):
        load_checkpoint(path)


def test_shape_mismatch_names_the_tensor(tmp_path):
    path = write_tiny_llama_gguf(tmp_path / "m.gguf", bad_shape=True)
    with pytest.raises(ModelFileError, match=r"model.layers.1.self_attn.k_proj.weight has shape"):
        tiny_engine(path)


def test_unsupported_quant_type(tmp_path):
    path = write_tiny_llama_gguf(tmp_path / "m.gguf", qtype=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(UnsupportedModelError, match="blk.0.ffn_down.weight.*Q8_1"):
        load_checkpoint(path)


def test_unknown_model_type_in_folder(tmp_path):
    folder = write_tiny_llama_folder(tmp_path / "m")
    cfg = (folder / "config.json").read_text().replace('"llama"', '"bogus_arch"')
    (folder / "config.json").write_text(cfg)
    with pytest.raises(UnsupportedModelError, match="bogus_arch"):
        load_checkpoint(folder)


def test_truncated_safetensors(tmp_path):
    folder = write_tiny_llama_folder(tmp_path / "m")
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(ModelFileError, match="model.safetensors could not be read"):
        load_checkpoint(folder)


def test_cuda_asked_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        Engine(EngineConfig(model="builtin:smollm2-135m", backend="tandem", device="cuda"))


def test_bad_policy_is_refused_before_loading():
    with pytest.raises(ConfigError, match="kv_policy"):
        Engine(EngineConfig(kv_policy="fixed:1.7"))


def test_folder_model_matches_transformers(tmp_path):
    """A tiny random LlamaForCausalLM: Tandem's logits and greedy tokens equal transformers'."""
    from transformers import LlamaForCausalLM

    folder = write_tiny_llama_folder(tmp_path / "m")
    engine = tiny_engine(folder)
    assert engine.tokenizer is None  # no tokenizer files: ids-only use still works
    ref = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [3, 17, 5, 42, 8, 9, 33]
    with torch.inference_mode():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert engine.generate_ids(prompt, 20) == theirs


def test_gguf_q_k_permutation_round_trip(tmp_path):
    """Weights written llama.cpp-style (q/k rows permuted) load to the same model as the folder."""
    from safetensors.torch import load_file

    folder = write_tiny_llama_folder(tmp_path / "m")
    sd = load_file(folder / "model.safetensors")
    c = TINY
    hd = c["dim"] // c["heads"]

    def permute(w, n_head):  # what llama.cpp's converter does to q_proj / k_proj
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_block_count(c["layers"]); w.add_context_length(c["ctx"]); w.add_embedding_length(c["dim"])
    w.add_feed_forward_length(c["ffn"]); w.add_head_count(c["heads"]); w.add_head_count_kv(c["kv_heads"])
    w.add_rope_freq_base(10000.0); w.add_layer_norm_rms_eps(1e-6); w.add_rope_dimension_count(hd)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    for i in range(c["layers"]):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"].numpy()
            if gg == "attn_q":
                t = permute(t, c["heads"])
            elif gg == "attn_k":
                t = permute(t, c["kv_heads"])
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    prompt = [3, 17, 5, 42, 8, 9, 33]
    assert tiny_engine(tmp_path / "m.gguf").generate_ids(prompt, 16) == tiny_engine(folder).generate_ids(prompt, 16)


def test_engine_usable_after_a_failed_load(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(ModelFileError):
        tiny_engine(bad)
    good = write_tiny_llama_gguf(tmp_path / "good.gguf")
    assert len(tiny_engine(good).generate_ids([1, 2, 3], 4)) == 4
