"""gpt-oss under the hybrid KV policies (simulate_hybrid, fp32, CPU) against resident KV.

The baby model (test_gpt_oss.tiny: a 4-token window on layers 0 and 2, full attention on 1 and 3,
random sinks) runs with 4-token blocks and an 8-token D-window, so a 44-token context spans the
window, the D-window and the placed share many times over: the window layers' KV stays resident
(engine/kv/layer_split.py), the full layers' KV goes through the policy with the sinks merged once.
Logits of a prefill, decode steps, a second prefill in two chunks and more decode steps must equal
resident KV's within moe_helpers.FP32_ATOL (fp32: the same softmax merged in another order; observed
≤ 3e-6); telemetry shows the CPU share (or the stream, or the monolithic copies) really ran.
"""

import pytest
import torch
from moe_helpers import FP32_ATOL, tiny_engine
from test_gpt_oss import saved, tiny

from engine.kv.layer_split import LayerSplitKV

IDS = [(i * 7 + 3) % 96 for i in range(44)]
# (start, end) of each forward: a 20-token prefill, 6 decode steps, a 14-token prefill in two
# chunks (a new turn), 4 decode steps
STEPS = [(0, 20)] + [(i, i + 1) for i in range(20, 26)] + [(26, 33), (33, 40)] + [(i, i + 1) for i in range(40, 44)]
SMALL = {"max_context": 64, "block_size": 4, "d_window": 8}  # tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return saved(tmp_path_factory.mktemp("oss"), tiny(seed=7))


@pytest.fixture(scope="module")
def resident(folder):
    return tiny_engine(folder, max_context=64)


@torch.inference_mode()
def run_steps(engine, steps=STEPS, ids=IDS):
    """Logits (T, V) of every step's tokens, and the KV's telemetry before the sequence is freed."""
    p, kv = engine.parts, engine.parts.kv
    sid = kv.new_sequence()
    rows = []
    try:
        for a, b in steps:
            positions = kv.begin_step([sid], b - a)
            rows.append(p.model(torch.tensor([ids[a:b]]), positions, kv, last_only=False)[0])
            kv.end_step()
        return torch.cat(rows), kv.telemetry()
    finally:
        kv.free(sid)


@pytest.mark.parametrize("policy", ["writescope", "gpu-centric", "cpu-centric", "fixed:0.5", "monolithic"])
def test_hybrid_policies_equal_resident(folder, resident, policy):
    engine = tiny_engine(folder, kv_policy=policy, simulate_hybrid=True, **SMALL)
    kv = engine.parts.kv
    assert isinstance(kv, LayerSplitKV) and kv.policy == policy
    assert (kv.n_resident_layers, kv.n_hybrid_layers) == (2, 2)
    expected, _ = run_steps(resident)
    got, tel = run_steps(engine)
    torch.testing.assert_close(got, expected, atol=FP32_ATOL, rtol=0)
    assert tel["tokens"]["resident"] == len(IDS) and tel["bytes"]["kv_resident"] > 0
    if policy == "monolithic":
        assert tel["pcie"]["h2d_bytes"] > 0  # the past came through the staging buffer
    elif policy == "gpu-centric":
        assert tel["tokens"]["pinned"] > 0 and tel["pcie"]["h2d_bytes"] > 0 and tel["cpu_kernel"] is None
    else:  # the CPU attended its share of the full layers
        assert tel["tokens"]["unpinned"] > 0 and tel["cpu_kernel"] is not None


def test_a_dropped_sink_would_be_caught(folder, resident, monkeypatch):
    """Guard: writescope merging without the sinks gives other logits, so the test above tests them."""
    from engine.kv.writescope import WriteScopeKV

    merge = WriteScopeKV._merge
    monkeypatch.setattr(WriteScopeKV, "_merge", lambda self, plan, parts, chunks, dtype, sinks=None:
                        merge(self, plan, parts, chunks, dtype))
    engine = tiny_engine(folder, kv_policy="writescope", simulate_hybrid=True, **SMALL)
    got, _ = run_steps(engine)
    assert (got - run_steps(resident)[0]).abs().max() > 1e-2


@torch.inference_mode()
def _batch(engine):
    """Two sequences of unequal lengths (30 and 17 tokens) decoded together for 4 steps; the second
    cropped back by 5 tokens and read again before. → logits of every decode step, (4, 2, V)."""
    p, kv = engine.parts, engine.parts.kv
    a, b = kv.new_sequence(), kv.new_sequence()
    try:
        for sid, (lo, hi) in ((a, (0, 30)), (b, (10, 27))):
            positions = kv.begin_step([sid], hi - lo)
            p.model(torch.tensor([IDS[lo:hi]]), positions, kv)
            kv.end_step()
        kv.crop(b, 12)
        positions = kv.begin_step([b], 5)
        p.model(torch.tensor([IDS[22:27]]), positions, kv)
        kv.end_step()
        out = []
        for t in range(4):
            positions = kv.begin_step([a, b], 1)
            out.append(p.model(torch.tensor([[IDS[30 + t]], [IDS[27 + t]]]), positions, kv)[:, -1])
            kv.end_step()
        return torch.stack(out)
    finally:
        kv.free(a)
        kv.free(b)


@pytest.mark.parametrize("policy", ["writescope", "monolithic"])
def test_a_batch_of_unequal_lengths_and_a_crop_equal_resident(folder, resident, policy):
    engine = tiny_engine(folder, kv_policy=policy, simulate_hybrid=True, **SMALL)
    torch.testing.assert_close(_batch(engine), _batch(resident), atol=FP32_ATOL, rtol=0)


def test_generation_and_a_second_turn_equal_resident(folder, resident):
    """Through the generator: a reply, then the same prompt again (the KV is cropped and reused)."""
    engine = tiny_engine(folder, kv_policy="writescope", simulate_hybrid=True, **SMALL)
    for _ in range(2):
        assert engine.generate_ids(IDS[:30], 8) == resident.generate_ids(IDS[:30], 8)


def test_decode_graphs_are_declined(folder):
    """The composite is no ResidentKV: decode steps run eagerly, never as a graph of a hybrid step."""
    from engine.runtime.decode_graph import unsupported_reason

    engine = tiny_engine(folder, kv_policy="writescope", simulate_hybrid=True, **SMALL)
    kv = engine.parts.kv
    assert not kv.replayable_step()
    assert "writescope" in unsupported_reason(kv, None, torch.device("cuda"), 1)


def test_windows_that_never_bind_need_no_split(folder):
    """A context within the 4-token window: every layer is full attention, one hybrid backend."""
    from engine.kv.writescope import WriteScopeKV

    engine = tiny_engine(folder, kv_policy="writescope", simulate_hybrid=True, max_context=4, block_size=4,
                         d_window=4)
    assert isinstance(engine.parts.kv, WriteScopeKV)
    assert len(engine.generate_ids(IDS[:3], 1)) == 1


def test_the_planner_spills_only_the_full_layers():
    """gpt-oss-20b at 128K under a budget that holds the weights but not all of the KV: writescope,
    the 12 window layers' KV on the GPU (12 × 131072 tokens × 2 KiB: K and V of 8 heads × 64 dims in
    bf16) and the 12 full layers' KV in RAM."""
    from engine.api import EngineConfig
    from engine.runtime.planning import placement_plan

    p = placement_plan(EngineConfig(model="synthetic:gpt-oss-20b", backend="tandem", simulate_hybrid=True,
                                    dtype="bfloat16", vram_budget_gb=44, max_context=131072, max_batch=1))
    assert p.fits and p.kv_policy == "writescope"
    rows = {r.part: r for r in p.rows}
    half = 12 * 131072 * 2048
    assert rows["KV of the sliding-window layers (12)"].where == "GPU"
    assert rows["KV of the sliding-window layers (12)"].bytes == half
    assert rows["KV cache (spilled)"].where == "RAM" and rows["KV cache (spilled)"].bytes == half
    assert rows["KV D-window and ping-pong"].bytes < 64 << 20  # 12 layers' D-windows and two buffers
