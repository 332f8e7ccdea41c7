"""Synthetic real-shape models: preset configs, names, seeded generation, a long finite decode."""

import time

import pytest
import torch

from engine.api import Engine, EngineConfig
from engine.errors import ConfigError
from engine.models import families, synthetic
from engine.models.assemble import tensor_shapes
from moe_helpers import engine_logits

SMALLEST = "synthetic:olmoe-1b-7b-L1"  # 0.63 B parameters, 1.25 GB in bf16


def n_params(name: str) -> float:
    config = synthetic.config_for(name)
    args = families.for_model_type(config["model_type"], name).args_from_config(config)
    return sum(torch.Size(s).numel() for s in tensor_shapes(args).values()) / 1e9


def test_presets_have_the_published_sizes():
    assert n_params("synthetic:qwen3-30b-a3b") == pytest.approx(30.53, abs=0.01)
    assert n_params("synthetic:mixtral-8x7b") == pytest.approx(46.70, abs=0.01)
    assert n_params("synthetic:olmoe-1b-7b") == pytest.approx(6.92, abs=0.01)
    assert n_params("synthetic:llama-3.2-1b") == pytest.approx(1.2358, abs=1e-4)  # dense, tied embeddings


def test_presets_are_valid_transformers_configs():
    """Each preset builds the transformers config of its family with the same shape."""
    from transformers import AutoConfig

    for name in synthetic.names():
        config = synthetic.config_for(name)
        hf = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
        assert hf.num_hidden_layers == config["num_hidden_layers"] and hf.hidden_size == config["hidden_size"]


def test_layer_suffix():
    assert synthetic.parse("synthetic:qwen3-30b-a3b-L12") == ("qwen3-30b-a3b", 12)
    assert synthetic.parse("synthetic:mixtral-8x7b") == ("mixtral-8x7b", None)
    assert synthetic.config_for("synthetic:qwen3-30b-a3b-L12")["num_hidden_layers"] == 12
    per_layer = (128 * 3 * 2048 * 768 + 2 * 2048 * 4096 + 2 * 2048 * 512 + 128 * 2048 + 2 * 2048 + 2 * 128) / 1e9
    assert n_params("synthetic:qwen3-30b-a3b-L16") == pytest.approx(2 * 151936 * 2048 / 1e9 + 16 * per_layer, abs=1e-5)


@pytest.mark.parametrize("bad", ["synthetic:qwen3-30b", "synthetic:mixtral-8x7b-L0", "synthetic:olmoe-1b-7b-L17",
                                 "synthetic:", "synthetic:olmoe-1b-7b-Lx"])
def test_bad_names_are_refused(bad):
    with pytest.raises(ConfigError):
        Engine(EngineConfig(model=bad, device="cpu"))


@pytest.fixture(scope="module")
def smallest():
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=SMALLEST, device="cpu", max_batch=1, max_context=256))
    engine.build_s = time.perf_counter() - t0
    yield engine
    engine.close()


def test_loads_quickly_in_bf16_without_tokenizer_or_eos(smallest):
    assert smallest.build_s < 30
    assert smallest.info()["dtype"] == "bfloat16" and smallest.info()["load_s"] < 30
    assert smallest.tokenizer is None and smallest.parts.args.eos_token_ids == []
    gate_up = smallest.parts.experts.gate_up
    assert len(gate_up) == 1 and gate_up[0].shape == (64, 2048, 2048)  # stacked (E, 2I, H) per layer


def test_fifty_decode_steps_stay_finite(smallest):
    prompt = [11, 500, 7, 32000, 12]
    steps = []  # the logits of every forward, captured from the real decode path
    hook = smallest.parts.model.lm_head.register_forward_hook(lambda m, i, out: steps.append(out.float()))
    try:
        out = smallest.generate_ids(prompt, 50)
    finally:
        hook.remove()
    assert len(out) == 50 and len(steps) == 50  # no EOS: always runs to max_new_tokens (1 prefill + 49 decode)
    logits = torch.cat([s.reshape(-1, s.shape[-1]) for s in steps])
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 0.1  # not collapsed
    assert len(set(out)) > 10  # and not stuck on one token


def test_same_seed_same_weights_other_seed_other_weights(smallest):
    model, experts = smallest.parts.model, smallest.parts.experts
    again = synthetic.load(SMALLEST, device=torch.device("cpu"), seed=synthetic.DEFAULT_SEED).tensors
    assert torch.equal(again["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert torch.equal(again["model.layers.0.mlp.experts.gate_up_proj"], experts.gate_up[0])
    assert torch.equal(again["lm_head.weight"], model.lm_head.weight)
    del again
    other = synthetic.load(SMALLEST, device=torch.device("cpu"), seed=1).tensors
    assert not torch.equal(other["model.layers.0.mlp.gate.weight"], model.model.layers[0].mlp.gate.weight)
    assert torch.equal(other["model.norm.weight"], model.model.norm.weight)  # norms are ones either way


def test_random_router_spreads_tokens_near_uniformly(smallest):
    """The worst case for an expert cache, by construction: every expert gets a share."""
    layer = smallest.parts.model.model.layers[0].mlp
    x = torch.randn(512, 2048, dtype=torch.bfloat16)
    _, ids = layer.route(layer.gate(x), layer.top_k, layer.renormalise)
    counts = torch.bincount(ids.flatten(), minlength=64).float()  # 4096 choices over 64 experts: 64 each
    assert counts.min() > 0.3 * counts.mean() and counts.max() < 3 * counts.mean()


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qwen3_30b_a3b_is_ready_on_the_gpu_within_a_minute():
    engine = Engine(EngineConfig(model="synthetic:qwen3-30b-a3b", device="cuda", max_batch=4, max_context=8192))
    assert engine.info()["load_s"] < 60
    assert engine.parts.experts.gate_up[0].device.type == "cuda"
    assert engine.parts.experts.gate_up[0].shape == (128, 1536, 2048)
    out = engine.generate_ids([1, 2, 3, 4], 16)
    logits = engine_logits(engine, [1, 2, 3, 4] + out, prefill=4)
    assert len(out) == 16 and torch.isfinite(logits).all()
    engine.close()
