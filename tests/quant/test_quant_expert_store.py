"""Offloaded experts from a quantised GGUF stay quantised in the host store (issue #33, item 4): a
block is the expert's gate, up and down bytes as the file has them, fills move those bytes and
dequantise into the slots, the CPU set computes over the blocks in place; the engine's output follows
the same file dequantised to float32 under every offload policy (simulated hybrid on the CPU).

Logit tolerance as in test_quant_experts_gguf.py (helpers.quant_logit_tolerance: 1e-3 of max |logit|,
4e-2 where AVX2's K-quant products read int8 activations): the CPU set's products round their
activations; slots hold the exact dequantised weights.
"""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_follows, quant_logit_tolerance
from helpers import stepped_logits as logits
from test_quant_experts_gguf import PROMPT, engine_for, file_expert_bytes, write_quantised

from engine.experts.cache import ExpertCache
from engine.experts.store import ExpertStore, QuantLayout
from engine.models.loader import load_checkpoint
from engine.quant.blocks import QuantStack, dequantize_blocks_torch
from engine.runtime.planning import placement_plan

pytest.importorskip("llama_cpp")

POLICIES = ("cpu-only", "on-demand", "adaptive")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant-store")
    return {ftype: write_quantised(d, "qwen3_moe", ftype) for ftype in ("Q4_K_M", "Q8_0")}


def experts_of(path):
    """(gate_up stacks, down stacks) per layer in blocks, and the same dequantised to float32."""
    kept = load_checkpoint(path, torch.float32, expert_blocks=True).tensors
    plain = load_checkpoint(path, torch.float32).tensors
    names = [f"model.layers.{l}.mlp.experts." for l in range(2)]
    blocks = ([kept[n + "gate_up_proj"] for n in names], [kept[n + "down_proj"] for n in names])
    floats = ([plain[n + "gate_up_proj"] for n in names], [plain[n + "down_proj"] for n in names])
    return blocks, floats


def test_store_holds_the_files_expert_bytes_and_dequantises_to_the_file(files):
    path = files["Q4_K_M"]
    (gate_up, down), (gate_up_f, down_f) = experts_of(path)
    assert all(isinstance(t, QuantStack) for t in (*gate_up, *down))
    store = ExpertStore.from_quant_layers(gate_up, down, dtype=torch.float32)
    assert store.quantised and store.blocks.dtype == torch.uint8
    # the file's bytes, plus the padding of layers whose blocks are shorter than the longest one's
    longest = max(layout.nbytes for layout in store.layouts.values())
    assert store.nbytes == 2 * 8 * longest and file_expert_bytes(path) <= store.nbytes
    assert store.nbytes <= 1.15 * file_expert_bytes(path)
    assert store.slot_bytes == longest  # a GPU slot holds the blocks as they are
    for layer in store.layers:
        layout = store.layouts[layer]
        assert "Q4_K" in layout.types
        blocks = torch.stack([store.block(layer, e) for e in range(8)])  # (8, block bytes)
        values = layout.dequantize(blocks)  # (8, P)
        want = torch.cat([gate_up_f[layer].flatten(1), down_f[layer].flatten(1)], dim=1)
        assert torch.equal(values, want)
        gate_up_view, down_view = store.expert(layer, 3)
        assert torch.equal(gate_up_view.dequantize(), gate_up_f[layer][3])
        assert torch.equal(down_view.dequantize(), down_f[layer][3])
        assert down_view.blocks.data_ptr() == store.block(layer, 3).data_ptr() + layout.parts[2][3]  # in place
    with pytest.raises(ValueError, match="quantised"):
        store.moe_rows(0)


def test_torch_dequantisation_matches_the_native_one_for_each_part(files):
    """What a GPU fill runs (torch ops on the device) against what the CPU runs (native)."""
    path = files["Q4_K_M"]
    (gate_up, down), _ = experts_of(path)
    store = ExpertStore.from_quant_layers(gate_up, down, dtype=torch.float32)
    for layer, layout in store.layouts.items():
        blocks = torch.stack([store.block(layer, e) for e in range(8)])
        native = layout.dequantize(blocks)
        offset = 0
        for code, rows, cols, at, nbytes in layout.parts:
            part = blocks[:, at:at + nbytes].reshape(8 * rows, nbytes // rows)
            torch_values = dequantize_blocks_torch(part, code).reshape(8, rows * cols)
            assert torch.equal(torch_values, native[:, offset:offset + rows * cols])
            offset += rows * cols


def test_a_fill_copies_the_blocks_into_the_slot(files):
    (gate_up, down), (gate_up_f, down_f) = experts_of(files["Q8_0"])
    store = ExpertStore.from_quant_layers(gate_up, down, dtype=torch.float32)
    cache = ExpertCache(4, 256, 256, torch.float32, torch.device("cpu"), block_bytes=store.block_bytes)
    cache.copy_in_many([2, 0], [store.block(1, 5), store.block(1, 6)])
    assert cache.gate_up is None and cache.nbytes == 4 * store.block_bytes
    values = store.layouts[1].dequantize(cache.pool[[2, 0]])  # (2, P): the slots read as the kernels read them
    want = torch.stack([torch.cat([gate_up_f[1][e].flatten(), down_f[1][e].flatten()]) for e in (5, 6)])
    assert torch.equal(values, want)
    assert cache.allocations == 1


def test_layout_refuses_rows_that_are_not_whole_blocks():
    from engine.errors import ModelFileError

    with pytest.raises(ModelFileError):
        QuantLayout((12, 12, 14), hidden=100, expert_ffn=256)  # Q4_K needs 256-weight rows


@pytest.mark.parametrize("policy", POLICIES)
def test_offloaded_quantised_experts_follow_the_dequantised_file(files, policy):
    path = files["Q4_K_M"]
    quant = engine_for(path, expert_policy=policy, simulate_hybrid=True, expert_cache_slots=5)
    ref = engine_for(path, dtype="float32")
    try:
        experts = quant.backend.parts.experts
        assert experts.store.quantised and experts.store.nbytes <= 1.15 * file_expert_bytes(path)
        assert experts.costs.expert_bytes == experts.store.block_bytes  # link and CPU move the blocks
        for prefill in (len(PROMPT), 12):
            got, want = logits(quant, PROMPT, prefill), logits(ref, PROMPT, prefill)
            scale = float(want.abs().max())
            assert scale > 0.1 and float((got - want).abs().max()) <= quant_logit_tolerance() * scale
        assert greedy_follows(quant, ref, PROMPT, 8)
        stats = experts.telemetry()
        assert "Q4_K" in stats["store_types"]
        assert stats["zero_copy"] == {"off": "needs CUDA and Triton"}
        assert stats["h2d_bytes"] % experts.store.block_bytes == 0  # every copy a quantised block
        host = quant.stats().to_dict()["host"]  # what the app's memory panel shows
        assert host["expert_store"] == experts.store.nbytes and host["expert_store_types"] == stats["store_types"]
        if policy == "cpu-only":
            assert stats["cpu_executed"] > 0 and stats["fills"] == 0
        if policy == "on-demand":
            assert stats["fills"] > 0
    finally:
        quant.close()
        ref.close()


def test_plan_counts_the_experts_in_blocks_on_both_sides(files):
    """The GPU keeps a GGUF's routed experts in their blocks, resident or in cache slots, as the host
    store does: the plan sizes every side by the blocks."""
    from engine.api import EngineConfig

    path = files["Q4_K_M"]
    experts = file_expert_bytes(path)

    def plan(budget_gb):
        config = EngineConfig(model=str(path), device="cpu", simulate_hybrid=True, vram_budget_gb=budget_gb,
                              max_context=256, max_batch=1)
        p = placement_plan(config)
        return p, {r.part: r for r in p.rows}

    # 6 MB: the dense weights, KV and the experts in blocks (1.9 MB; 6.3 MB in fp32) fit
    p, rows = plan(0.006)
    assert p.expert_policy == "resident" and rows["routed experts (all)"].where == "GPU"
    assert experts <= rows["routed experts (all)"].bytes <= 1.15 * experts
    # 4 MB: the experts do not fit beside the rest, so they stay in RAM, all or behind a cache
    p, rows = plan(0.004)
    assert p.expert_policy in ("adaptive", "cpu-only")
    store = rows["routed experts (store)" if p.expert_policy == "adaptive" else "routed experts (all)"]
    assert store.where == "RAM" and experts <= store.bytes <= 1.15 * experts
    if p.expert_policy == "adaptive":  # a slot holds an expert's blocks, as the store does
        assert rows["routed experts (cache)"].bytes == p.expert_cache_slots * store.bytes // 16


@pytest.mark.parametrize("policy", ("cpu-only", "on-demand"))
def test_offloaded_mxfp4_experts_with_their_form_follow_the_dequantised_file(tmp_path, policy):
    """gpt-oss: MXFP4 blocks in the store, the biased clamped SwiGLU on both sides of the split."""
    from test_mxfp4_experts_gguf import write_mxfp4_gpt_oss

    path = write_mxfp4_gpt_oss(tmp_path)
    quant = engine_for(path, expert_policy=policy, simulate_hybrid=True, expert_cache_slots=4)
    ref = engine_for(path, dtype="float32")
    try:
        experts = quant.backend.parts.experts
        assert experts.store.quantised and experts.telemetry()["store_types"] == ["MXFP4"]
        assert experts.forms  # the layers' biases and clamp
        got, want = logits(quant, PROMPT, len(PROMPT)), logits(ref, PROMPT, len(PROMPT))
        scale = float(want.abs().max())
        assert scale > 0.1 and float((got - want).abs().max()) <= quant_logit_tolerance() * scale
    finally:
        quant.close()
        ref.close()


@pytest.mark.parametrize("lead", [True, False])
def test_backend_auto_follows_which_engine_decodes_a_gguf_faster(files, tmp_path, monkeypatch, lead):
    """On a machine without a GPU: files Tandem computes over in blocks (a MoE whose experts stay blocks,
    a dense llama whose matrices are all kept types) decode faster on Tandem where its quantised kernels
    have AVX2 or AVX-512 (benchmarks/RESULTS.md) and go to llama.cpp on a CPU with neither; a dense file
    Tandem would dequantise, and a file it cannot read, go to llama.cpp (engine/api.py choose_backend)."""
    from engine import api
    from engine.api import EngineConfig, choose_backend
    from engine.bench import gguf_export
    from engine.models import builtin, synthetic

    monkeypatch.setattr(api, "_quant_kernels_lead", lambda: lead)
    want = "tandem" if lead else "llamacpp"
    assert choose_backend(EngineConfig(model=str(files["Q4_K_M"]), device="cpu")) == want
    dense, _ = builtin.resolve("builtin:smollm2-135m")  # the built-in dense GGUF (Q4_1), by its path
    assert choose_backend(EngineConfig(model=str(dense), device="cpu")) == want
    tiny = dict(synthetic.PRESETS["llama-3.2-1b"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_hidden_layers=1)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-llama", tiny)
    bf16 = tmp_path / "dense-bf16.gguf"
    gguf_export.export("synthetic:tiny-llama", bf16)  # BF16 matrices: Tandem's CPU load dequantises them
    assert choose_backend(EngineConfig(model=str(bf16), device="cpu")) == "llamacpp"
    assert choose_backend(EngineConfig(model=str(tmp_path / "missing.gguf"), device="cpu")) == "llamacpp"
    assert choose_backend(EngineConfig(model="builtin:smollm2-135m-moe", device="cpu")) == "tandem"


@pytest.mark.parametrize("isas, lead", [(["avx512", "avx2", "scalar"], True), (["avx2", "scalar"], True),
                                        (["scalar"], False)])
def test_the_kernels_lead_with_avx2_or_avx512(monkeypatch, isas, lead):
    from engine import api
    from engine.kernels import native

    monkeypatch.setattr(native.module(), "supported_quant_isas", lambda: isas)  # what this CPU would offer
    assert api._quant_kernels_lead() is lead
