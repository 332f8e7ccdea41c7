"""The built-in models against transformers' own implementation of the same GGUF weights."""

import pytest
import torch

PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain in detail how photosynthesis works in plants."]
N_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    from engine.models.builtin import smollm2_gguf

    path = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers(dense_engine, hf_model, prompt):
    ids = dense_engine.render([{"role": "user", "content": prompt}])
    ours = dense_engine.generate_ids(ids, N_TOKENS)
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=N_TOKENS, do_sample=False)
    theirs = out[0, len(ids):].tolist()
    assert len(ours) == N_TOKENS  # the prompts are chosen to answer at length: no early EOS
    assert ours == theirs


@pytest.mark.parametrize("prompt", PROMPTS)
def test_upcycled_moe_equals_dense(dense_engine, moe_engine, prompt):
    ids = dense_engine.render([{"role": "user", "content": prompt}])
    assert moe_engine.generate_ids(ids, N_TOKENS) == dense_engine.generate_ids(ids, N_TOKENS)


def test_moe_really_routes_to_several_experts(moe_engine):
    """The upcycled router is a fixed random projection: tokens spread over the 8 experts."""
    info = moe_engine.info()
    assert info["experts"] == 8 and info["top_k"] == 2
    layer = moe_engine.backend.parts.model.model.layers[0].mlp
    x = torch.randn(64, moe_engine.backend.parts.args.dim)
    _, ids = layer.route(layer.gate(x), layer.top_k)
    assert len(torch.unique(ids)) >= 6
