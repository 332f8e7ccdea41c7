"""Synthetic presets with quantised routed experts (`…-Q4_0`, `…-Q8_0`): the torch quantiser against
gguf's, the experts kept in blocks, an engine decoding them, and the plan sizing them by their blocks."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine.api import Engine, EngineConfig
from engine.errors import ConfigError
from engine.models import synthetic
from engine.quant.blocks import QuantStack
from engine.quant.quantise import quantise
from engine.runtime.planning import placement_plan
from moe_helpers import engine_logits

SMALL = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
             max_position_embeddings=512)
GGUF_TYPES = {"Q8_0": GGMLQuantizationType.Q8_0, "Q4_0": GGMLQuantizationType.Q4_0}


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(synthetic.PRESETS, "tiny-qwen3", dict(synthetic.PRESETS["qwen3-30b-a3b"], **SMALL))
    return "synthetic:tiny-qwen3"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantise_writes_ggufs_bytes(qtype, dtype):
    """Byte for byte gguf's numpy quantiser (ggml's reference rounding), over blocks that test its
    edges: all zeros, a negative peak (Q4_0's scale takes the peak's sign), ties, halves."""
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    w[0, :32] = 0
    w[1, 5] = -3.0
    w[2, :32] = 0.5
    w[3, 32:64] = torch.arange(32) / 2 - 8  # values on the rounding halves
    w = w.to(dtype)
    ours = quantise(w, qtype)
    assert ours.dtype == torch.uint8 and ours.shape == (24, 128 // 32 * (34 if qtype == "Q8_0" else 18))
    np.testing.assert_array_equal(ours.numpy(), quants.quantize(w.float().numpy(), GGUF_TYPES[qtype]))


def test_quantise_refuses_other_types_and_partial_blocks():
    with pytest.raises(ConfigError, match="no quantiser for Q4_K"):
        quantise(torch.zeros(2, 64), "Q4_K")
    with pytest.raises(ConfigError, match="not whole blocks"):
        quantise(torch.zeros(2, 48), "Q8_0")


def test_the_preset_keeps_its_bf16_experts_quantised(tiny):
    """Same seed, same experts: the -Q8_0 preset's stacks are the BF16 preset's quantised, and only
    the routed experts change."""
    plain = synthetic.load(tiny, device=torch.device("cpu"))
    blocks = synthetic.load(tiny + "-Q8_0", device=torch.device("cpu"))
    assert synthetic.expert_quant(tiny + "-Q8_0") == "Q8_0" and synthetic.expert_quant(tiny) is None
    stacks = [n for n, t in blocks.tensors.items() if isinstance(t, QuantStack)]
    assert sorted(stacks) == sorted(n for n in plain.tensors if ".mlp.experts." in n) and len(stacks) == 4
    for name, t in blocks.tensors.items():
        if name in stacks:
            assert t.shape == tuple(plain.tensors[name].shape)
            expert = plain.tensors[name][3]  # (N, K) bf16
            got = t.experts[3].blocks
            torch.testing.assert_close(got, quantise(expert, "Q8_0"), rtol=0, atol=0)
            # Q8_0's error: half a step d = amax/127, plus up to 127 steps of d's own fp16 rounding
            # (2^-11 of d): 0.562 d
            d = expert.float().reshape(-1, 32).abs().amax(1, keepdim=True) / 127
            err = (t.experts[3].dequantize(torch.float32).reshape(-1, 32) - expert.float().reshape(-1, 32)).abs()
            assert bool((err <= d * (0.5 + 127 * 2 ** -11) + 1e-7).all())
        else:
            torch.testing.assert_close(t, plain.tensors[name], rtol=0, atol=0)


def test_an_engine_decodes_the_quantised_preset(tiny):
    """On the CPU the experts run over their blocks; the logits follow the BF16 preset's within the
    error Q8_0 adds, and a decode stays finite."""
    ids = [(7 * i + 3) % 128 for i in range(12)]
    config = dict(device="cpu", max_batch=1, max_context=64)
    plain, blocks = (Engine(EngineConfig(model=m, **config)) for m in (tiny, tiny + "-Q8_0"))
    try:
        assert blocks.parts.experts.block_types() == ["Q8_0"]
        a, b = engine_logits(plain, ids, prefill=8).float(), engine_logits(blocks, ids, prefill=8).float()
        cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert bool((cosine > 0.99).all()), cosine
        out = blocks.generate_ids(ids, 6)
        assert len(out) == 6 and all(0 <= t < 128 for t in out)
    finally:
        blocks.close()
        plain.close()


def test_the_plan_holds_quantised_experts_at_their_blocks_bytes():
    """Qwen3-30B-A3B's 4 layers: 512 experts of 3 · 2048 · 768 weights, 2 bytes each in BF16, 18 bytes
    a 32 in Q4_0; the plan's RAM differs by exactly that."""
    plans = {m: placement_plan(EngineConfig(model=m, device="cpu", max_batch=1, max_context=2048))
             for m in ("synthetic:qwen3-30b-a3b-L4", "synthetic:qwen3-30b-a3b-L4-Q4_0")}
    bf16, q4 = plans.values()
    assert bf16.fits and q4.fits
    weights = 4 * 128 * 3 * 2048 * 768
    assert bf16.ram_bytes - q4.ram_bytes == weights * 2 - weights // 32 * 18


@pytest.mark.parametrize("bad", ["synthetic:qwen3-30b-a3b-Q4_K", "synthetic:qwen3-30b-a3b-q4_0",
                                 "synthetic:qwen3-30b-a3b-Q8_0-L2"])
def test_unknown_block_types_and_orders_are_refused(bad):
    with pytest.raises(ConfigError, match="-Q4_0"):
        synthetic.parse(bad)


@pytest.mark.parametrize("policy", ["adaptive", "on-demand", "cpu-only"])
def test_offloaded_policies_decode_the_quantised_preset_as_resident(tiny, policy):
    """The blocks go into the host store and the (simulated) GPU's slots as a GGUF's do: a 4-slot
    cache's fills, misses and CPU sets give the resident engine's greedy tokens. fp32, as the other
    simulated-GPU tests: the slots' products run Triton's interpreter here, whose bf16 is not the GPU's."""
    ids = [3, 5, 7, 9, 11, 13]
    config = dict(model=tiny + "-Q4_0", device="cpu", dtype="float32", max_batch=1, max_context=64)
    resident = Engine(EngineConfig(**config))
    offloaded = Engine(EngineConfig(**config, expert_policy=policy, simulate_hybrid=True, expert_cache_slots=4))
    try:
        assert offloaded.generate_ids(ids, 8) == resident.generate_ids(ids, 8)
        experts = offloaded.stats().experts
        assert experts["misses"] > 0 and (experts["hits"] > 0) == (policy != "cpu-only")
    finally:
        offloaded.close()
        resident.close()
