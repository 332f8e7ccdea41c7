"""gpt-oss's offloaded experts computed by the native CPU kernel (issue #38): under `cpu-only` and
`adaptive` (simulated hybrid, 5 cache slots for 32 routed experts, the slots' experts in the grouped
path) the CPU set of every MoE layer
runs the biases and the clamped SwiGLU in one native call on the native worker, and the model
generates what resident execution generates.

The baby model is test_gpt_oss.tiny with I = 32 (the native kernel takes I a multiple of 16; the
other tests' I = 24 goes through torch), its expert pre-activations pushed past the ±7 clamp.
fp32: the same products summed in another order, logits within moe_helpers.FP32_ATOL.
"""

import pytest
import torch
from moe_helpers import FP32_ATOL, PROMPT, engine_logits, tiny_engine
from test_gpt_oss import saved, tiny

from engine.kernels import experts_cpu, native

if native.module() is None:
    pytest.skip("needs the native extension", allow_module_level=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return saved(tmp_path_factory.mktemp("oss_cpu"), tiny(seed=11, intermediate_size=32))


@pytest.fixture(scope="module")
def resident(folder):
    """Resident execution's greedy tokens and logits (prefill of 4, then decode steps)."""
    engine = tiny_engine(folder, max_context=64)
    return engine.generate_ids(PROMPT, 8), engine_logits(engine, PROMPT, prefill=4)


@pytest.fixture
def native_sets(monkeypatch):
    """The activation code of every CPU set the native worker is handed (1: the clamped SwiGLU)."""
    acts = []
    submit = experts_cpu.MoeWorker.submit

    def spy(self, prepared):
        acts.append(prepared.native_args[-4])
        return submit(self, prepared)

    monkeypatch.setattr(experts_cpu.MoeWorker, "submit", spy)
    return acts


@pytest.mark.parametrize("policy", ["cpu-only", "adaptive"])
def test_native_cpu_experts_generate_what_resident_generates(folder, resident, native_sets, policy):
    expected, logits = resident
    offloaded = tiny_engine(folder, expert_policy=policy, simulate_hybrid=True, kv_policy="resident",
                            expert_cache_slots=5, max_context=64)
    ex = offloaded.parts.experts
    assert len(ex.forms) == 4
    assert offloaded.generate_ids(PROMPT, 8) == expected
    torch.testing.assert_close(engine_logits(offloaded, PROMPT, prefill=4), logits, atol=FP32_ATOL, rtol=0)
    t = ex.telemetry()
    # adaptive: the warm slots (even spread) computed the hits in the grouped path, the CPU the misses
    assert t["cpu_executed"] > 0 and (t["hits"] > 0) == (policy == "adaptive")
    # every CPU set went to the native worker as one call of the clamped, biased form
    assert len(native_sets) > 0 and set(native_sets) == {1}
    kernel = offloaded.stats().to_dict()["kernels"]["cpu_experts"]
    assert kernel == experts_cpu.implementation(1) and kernel.startswith("native-")


def test_a_wrong_form_on_the_cpu_would_be_caught(folder, resident, monkeypatch):
    """Guard: the CPU set without the down biases gives other logits, so the test above tests them."""
    _, logits = resident
    prepare = experts_cpu.prepare_moe

    def without_down_bias(*args, form=None, **kw):
        if form is not None:
            form = type(form)(form.gate_up_bias, torch.zeros_like(form.down_bias), form.alpha, form.limit)
        return prepare(*args, form=form, **kw)

    monkeypatch.setattr(experts_cpu, "prepare_moe", without_down_bias)
    offloaded = tiny_engine(folder, expert_policy="cpu-only", simulate_hybrid=True, kv_policy="resident",
                            expert_cache_slots=5, max_context=64)
    assert (engine_logits(offloaded, PROMPT, prefill=4) - logits).abs().max() > 1e-2
