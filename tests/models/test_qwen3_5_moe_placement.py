"""Qwen3.5-MoE under the hybrid placements (simulated on the CPU): the full-attention layers' KV in
WriteScope's regions, the routed experts offloaded; the DeltaNet layers' recurrent state stays with
the compute device either way. Each must give what resident placement gives.
Tolerance: 1e-5 absolute on fp32 logits (the attention parts merge by LSE, the experts sum in
another order: rounding only).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
    pytest.skip("this transformers has no qwen3_5_moe", allow_module_level=True)

from moe_helpers import PROMPT, engine_logits, tiny_engine, write_layout  # noqa: E402
from test_qwen3_5_moe import tiny  # noqa: E402


@pytest.mark.parametrize("policy", ["writescope", "fixed:0.5", "cpu-centric", "gpu-centric", "monolithic"])
def test_hybrid_kv_equals_resident(tmp_path, policy):
    """A small D-window and block: a 12-token prompt and 20 decode steps place the two attention
    layers' KV in every region; a 40-token prefill places it in the host regions at once."""
    folder = write_layout(tiny(seed=10, num_hidden_layers=8), tmp_path / "m", "fused")
    resident = tiny_engine(folder, max_context=64)
    hybrid = tiny_engine(folder, kv_policy=policy, simulate_hybrid=True, d_window=8, block_size=4, max_context=64)
    kv = hybrid.parts.kv
    assert kv.recurrent and kv.inner.policy == policy
    assert hybrid.generate_ids(PROMPT, 20) == resident.generate_ids(PROMPT, 20)
    torch.testing.assert_close(engine_logits(hybrid, PROMPT + PROMPT, prefill=6),
                               engine_logits(resident, PROMPT + PROMPT, prefill=6), atol=1e-5, rtol=0)
    if policy == "monolithic":
        return
    sid = kv.new_sequence()
    with torch.inference_mode():
        positions = kv.begin_step([sid], 40)
        hybrid.parts.model(torch.tensor([list(range(40))]), positions, kv)
        kv.end_step()
    tokens = kv.telemetry()["tokens"]
    assert tokens["pinned"] + tokens["unpinned"] > 0  # (writescope's share follows its roofline: either side)
    if policy in ("fixed:0.5", "gpu-centric"):
        assert tokens["pinned"] > 0
    if policy in ("fixed:0.5", "cpu-centric"):
        assert tokens["unpinned"] > 0
    kv.free(sid)


@pytest.mark.parametrize("policy", ["adaptive", "on-demand", "cpu-only"])
def test_offloaded_experts_generate_what_resident_generates(tmp_path, policy):
    """Simulated hybrid with a VRAM budget holding a few of the 32 routed experts (4 layers × 8): the
    same tokens and logits as resident execution; the shared experts and their gates stay dense."""
    from engine.experts.offload import OffloadedExperts

    folder = write_layout(tiny(seed=11), tmp_path / "m", "fused")
    resident = tiny_engine(folder, max_context=64)
    expected = resident.generate_ids(PROMPT, 12)
    slot, kv = 3 * 32 * 16 * 4, 2 * 1 * 64 * 2 * 2 * 16 * 4  # one expert; K and V of 1 layer × 64 × max_batch 2
    budget = (resident.parts.weights_bytes + kv + 6 * slot) / 0.9 / 2**30  # (the tenth the cache sizing holds back)
    offloaded = tiny_engine(folder, expert_policy=policy, simulate_hybrid=True, vram_budget_gb=budget,
                            kv_policy="resident", max_context=64)
    ex = offloaded.parts.experts
    assert isinstance(ex, OffloadedExperts) and ex.store.n_routed == 32
    if policy != "cpu-only":
        assert 0 < ex.cache.n_slots < 32
    assert offloaded.generate_ids(PROMPT, 12) == expected
    torch.testing.assert_close(engine_logits(offloaded, PROMPT, prefill=4), engine_logits(resident, PROMPT, prefill=4),
                               atol=1e-5, rtol=0)
    t = ex.telemetry()
    assert t["misses"] > 0 and (t["cpu_executed"] > 0 or t["fills"] > 0)
