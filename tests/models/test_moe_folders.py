"""MoE checkpoints as folders: sharded with an index, and each bad-folder case's clear error."""

import json

import pytest
import torch

from engine.errors import ModelFileError, UnsupportedModelError
from engine.models.loader import load_checkpoint
from moe_helpers import PROMPT, assert_parity, engine_logits, tiny_engine, write_layout
from test_qwen3_moe import tiny


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A Qwen3-MoE folder that save_pretrained split into several shards plus an index."""
    ref = tiny(seed=7)
    folder = tmp_path_factory.mktemp("sharded") / "m"
    ref.save_pretrained(folder, max_shard_size="40KB")
    return ref, folder


def _shards(folder):
    return sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))


def test_sharded_folder_matches_transformers(sharded):
    ref, folder = sharded
    assert len(_shards(folder)) >= 3
    assert_parity(tiny_engine(folder), ref)


def test_experts_of_one_layer_across_shards_are_fused_in_order(sharded):
    _, folder = sharded
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    layer0 = {index[k] for k in index if k.startswith("model.layers.0.mlp.experts.")}
    ckpt = load_checkpoint(folder)
    assert ckpt.tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 32, 32)
    assert ckpt.tensors["model.layers.2.mlp.experts.down_proj"].shape == (8, 32, 16)
    assert not any(".experts.0." in k for k in ckpt.tensors)
    if any(".experts.0." in k for k in index):  # per-expert names (what transformers 5.24 writes)
        assert len(layer0) >= 2  # layer 0's experts really straddle shards


def test_missing_shard(sharded, tmp_path):
    import shutil

    _, folder = sharded
    copy = tmp_path / "m"
    shutil.copytree(folder, copy)
    gone = _shards(copy)[1]
    (copy / gone).unlink()
    with pytest.raises(ModelFileError, match=f"shard {gone} listed in model.safetensors.index.json is missing"):
        load_checkpoint(copy)


def test_truncated_shard(sharded, tmp_path):
    import shutil

    _, folder = sharded
    copy = tmp_path / "m"
    shutil.copytree(folder, copy)
    victim = copy / _shards(copy)[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(ModelFileError, match=f"{victim.name} could not be read") as e:
        load_checkpoint(copy)
    assert "again" in e.value.remedy


def test_missing_expert(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_layout(tiny(), tmp_path / "m", "per_expert")
    sd = load_file(folder / "model.safetensors")
    del sd["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(ModelFileError, match=r"m: layer 1 has missing up weights of experts \[5\]"):
        load_checkpoint(folder)


def test_config_with_fewer_experts_than_the_file(tmp_path):
    folder = write_layout(tiny(), tmp_path / "m", "per_expert")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_local_experts"] = 6
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match=r"experts \[6, 7\] beyond the 6 the config declares"):
        load_checkpoint(folder)


def test_fused_expert_shape_mismatch_names_the_tensor(tmp_path):
    folder = write_layout(tiny(), tmp_path / "m", "fused")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["moe_intermediate_size"] = 12
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match=r"model.layers.0.mlp.experts.gate_up_proj has shape \(8, 32, 32\), "
                                             r"the config needs \(8, 24, 32\)"):
        tiny_engine(folder)


def test_unknown_moe_model_type(tmp_path):
    folder = write_layout(tiny(), tmp_path / "m", "fused")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "qwen9_moe"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="qwen9_moe.*qwen3_moe"):
        load_checkpoint(folder)


def test_unsupported_activation(tmp_path):
    folder = write_layout(tiny(), tmp_path / "m", "fused")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="activation 'gelu'"):
        tiny_engine(folder)


def test_bf16_folder_loads_in_its_dtype(tmp_path):
    """A bf16 checkpoint run in bf16 on the CPU: finite logits close to the fp32 run."""
    ref = tiny(seed=8)
    folder = write_layout(ref.to(torch.bfloat16), tmp_path / "m", "per_expert")
    ours = engine_logits(tiny_engine(folder, dtype="bfloat16"), PROMPT)
    full = engine_logits(tiny_engine(folder, dtype="float32"), PROMPT)
    assert torch.isfinite(ours).all()
    assert (ours - full).abs().max() < 0.1 * full.abs().max()


def test_tokenizer_and_chat_template_come_from_the_folder(tmp_path):
    """A folder with tokenizer files: text in, text out, through the folder's own chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from engine.api import GenerationRequest

    vocab = {f"w{i}": i for i in range(95)} | {"<eos>": 95}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>",
                                  chat_template="{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}w3")
    folder = write_layout(tiny(seed=9), tmp_path / "m", "per_expert")
    tok.save_pretrained(folder)
    engine = tiny_engine(folder)
    assert engine.tokenizer is not None
    messages = [{"role": "user", "content": "w40 w41 w42"}]
    assert engine.render(messages) == [1, 40, 41, 42, 2, 3]
    result = engine.generate(GenerationRequest(messages=messages, max_new_tokens=10, greedy=True))
    assert result.token_ids == engine.generate_ids([1, 40, 41, 42, 2, 3], 10)
    assert result.text.split() == [f"w{t}" for t in result.token_ids if t != 95]
