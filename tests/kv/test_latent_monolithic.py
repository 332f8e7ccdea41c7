"""The monolithic comparison policy over latent rows (engine/kv/latent_monolithic.py), simulated on
the CPU: a tiny random DeepSeek-V2 decodes the tokens and logits of resident latent KV, for a
prefill, decode steps that splice every past row through the staging buffer, and a batch of
unequal lengths (padded rows masked). Tolerance: fp32, the new rows and the past merged by LSE
instead of one softmax: 1e-5."""

import pytest
import torch

from engine.api import Engine, EngineConfig
from engine.kv.latent_monolithic import LatentMonolithicKV
from engine.models import synthetic

PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 26]


@pytest.fixture
def tiny_deepseek(monkeypatch):
    small = dict(synthetic.PRESETS["deepseek-v2-lite"], vocab_size=128, hidden_size=64, intermediate_size=96,
                 moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-deepseek", small)

    def make(**kv):
        return Engine(EngineConfig(model="synthetic:tiny-deepseek-L3", device="cpu", dtype="float32", max_context=64,
                                   max_batch=2, expert_policy="resident", **kv))
    return make


def _decode(engine, prompts, steps):
    """Per-sequence prefill, then `steps` batched decode steps → logits (steps, B, vocab)."""
    p, kv = engine.parts, engine.parts.kv
    rows = []
    with torch.inference_mode():
        ids = [kv.new_sequence() for _ in prompts]
        for sid, prompt in zip(ids, prompts):
            positions = kv.begin_step([sid], len(prompt))
            p.model(torch.tensor([prompt]), positions, kv)
            kv.end_step()
        for token in range(7, 7 + steps):
            positions = kv.begin_step(ids, 1)
            rows.append(p.model(torch.tensor([[token]] * len(prompts)), positions, kv))
            kv.end_step()
        for sid in ids:
            kv.free(sid)
    return torch.stack(rows)


def test_monolithic_latent_rows_equal_resident(tiny_deepseek):
    resident = tiny_deepseek()
    mono = tiny_deepseek(kv_policy="monolithic", simulate_hybrid=True)
    kv = mono.parts.kv
    assert isinstance(kv, LatentMonolithicKV) and kv.host.shape == (3, 2, 64, 32 + 8)  # (L, batch, ctx, r + dr)
    assert mono.generate_ids(PROMPT, 12) == resident.generate_ids(PROMPT, 12)
    unequal = [PROMPT[:5], PROMPT]
    torch.testing.assert_close(_decode(mono, unequal, 6), _decode(resident, unequal, 6), atol=1e-5, rtol=0)
    tel = kv.telemetry()
    assert tel["r_deployed"] == 0.0 and tel["pcie"]["h2d_bytes"] > 0  # every past row went through the copy


def test_a_second_prefill_chunk_attends_to_the_first(tiny_deepseek):
    """A prompt in two steps (the second's queries over the spliced past and causally over their own
    rows) gives the logits of one step: the past is really read, not only the new rows."""
    mono = tiny_deepseek(kv_policy="monolithic", simulate_hybrid=True)
    p, kv = mono.parts, mono.parts.kv

    def last_logits(chunks):
        sid = kv.new_sequence()
        with torch.inference_mode():
            for chunk in chunks:
                positions = kv.begin_step([sid], len(chunk))
                out = p.model(torch.tensor([chunk]), positions, kv)[0]
                kv.end_step()
        kv.free(sid)
        return out

    whole = last_logits([PROMPT])
    torch.testing.assert_close(last_logits([PROMPT[:7], PROMPT[7:]]), whole, atol=1e-5, rtol=0)
    assert not torch.allclose(last_logits([PROMPT[7:]]), whole, atol=1e-3)  # without the past: other logits
