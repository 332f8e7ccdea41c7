"""The placement planner on tables of sizes and costs: real shapes (Qwen3-30B-A3B, the built-in
MoE), tiny and too-big models, with and without calibrated costs, with and without a GPU."""

import pytest
import torch

from engine.kv.partition import PartitionSpec
from engine.models import families, synthetic
from engine.models.sizes import model_parts
from engine.sched import placement
from engine.sched.expert_cost import ExpertCostModel
from engine.sched.placement_speed import (GiB, MachineCosts, ModelParts, Placement, decode_ms, lru_hit_rate,
                                          unique_experts)
from engine.sched.roofline import RooflineParams


def plan(m: ModelParts, c: MachineCosts, *, max_context: int, max_batch: int, kv_shape=(4, 128, torch.bfloat16)):
    """placement.plan with the spilled KV's device bytes laid out as the engine lays them out."""
    n_kv, hs, dtype = kv_shape
    spec = PartitionSpec.for_shape(n_kv, hs, dtype, cuda=True, max_context=max_context)
    spill = spec.device_bytes(m.n_layers, max_batch, n_kv, hs, dtype)
    return placement.plan(m, c, max_context=max_context, max_batch=max_batch, spill_device_bytes=spill,
                          prefill_chunk=512)


def preset(name: str, dtype_bytes: int = 2) -> ModelParts:
    config = synthetic.config_for(name)
    args = families.for_model_type(config["model_type"], None).args_from_config(config)
    return model_parts(args, dtype_bytes, name)


def machine(vram_gb: float, ram_gb: float = 128, gpu: bool = True, **expert_costs) -> MachineCosts:
    # Qwen3-30B-A3B's layer: 2 KiB of KV per token; the defaults of kv/partition.py on a Gen4 link
    kv = RooflineParams(A_ns_per_token=2048 / 10.0, B_ns_per_token=2048 / 25.0, delta_ms=0.1)
    return MachineCosts(gpu=gpu, vram_bytes=int(vram_gb * GiB), ram_bytes=int(ram_gb * GiB),
                        experts=ExpertCostModel.from_shape(2048, 768, 2, **expert_costs), kv=kv, dram_gbps=90.0)


L16 = preset("synthetic:qwen3-30b-a3b-L16")


def test_sizes_of_qwen3_30b_a3b_follow_its_published_shape():
    full = preset("synthetic:qwen3-30b-a3b")
    assert full.expert_bytes == 3 * 2048 * 768 * 2  # gate, up, down in bf16: 9.4 MB
    assert full.n_routed == 48 * 128
    assert full.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2  # K and V, 4 KV heads of 128, 48 layers
    assert 56 * GiB < full.weights_bytes < 58 * GiB  # 30.5 B parameters in bf16
    assert L16.routed_bytes == full.routed_bytes // 3


def test_everything_on_the_gpu_when_it_fits():
    p = plan(L16, machine(48), max_context=2048, max_batch=1)
    assert p.fits and p.device == "gpu"
    assert (p.kv_policy, p.expert_policy, p.expert_cache_slots) == ("resident", "resident", None)
    assert p.vram_bytes <= 48 * GiB and p.ram_bytes == 0
    assert p.summary().startswith("fits on the GPU")


def test_experts_larger_than_the_budget_are_cached_and_the_rest_lives_in_ram():
    p = plan(L16, machine(8), max_context=2048, max_batch=1)
    assert p.fits and p.device == "gpu" and p.expert_policy == "adaptive"
    assert p.kv_policy == "resident"  # a 2K chat's KV (64 MiB) is worth more per byte than 7 expert slots
    slots_bytes = p.expert_cache_slots * L16.expert_bytes
    assert 0.5 * 8 * GiB < slots_bytes < 8 * GiB - L16.dense_bytes
    assert p.vram_bytes <= 8 * GiB
    assert next(r for r in p.rows if r.part == "routed experts (store)").where == "RAM"
    assert "experts cached" in p.summary()
    # the choice is the fastest candidate of the cost model
    fitting = [c for c in p.candidates if c["fits"]]
    assert max(c["decode_tok_s"] for c in fitting) == pytest.approx(p.decode_tok_s, rel=0.25)


def test_long_contexts_of_many_chats_hand_the_budget_from_experts_to_the_kv():
    short = plan(L16, machine(24), max_context=2048, max_batch=4)
    long = plan(L16, machine(24), max_context=32768, max_batch=4)
    assert short.expert_policy == "resident"  # 18 GiB of experts + 0.1 GiB of KV fit
    assert long.kv_policy == "resident" and long.expert_policy == "adaptive"  # 4 GiB of KV beat 440 slots
    assert long.expert_cache_slots < L16.n_routed


def test_more_budget_never_predicts_slower_decode():
    speeds = [plan(L16, machine(g), max_context=8192, max_batch=1).decode_tok_s for g in (2, 4, 8, 16, 24, 48)]
    assert speeds == sorted(speeds)


def test_a_budget_of_zero_runs_everything_on_the_cpu():
    p = plan(L16, machine(0), max_context=2048, max_batch=1)
    assert p.fits and p.device == "cpu" and p.vram_bytes == 0
    assert "leave no room on the GPU" in p.reason


def test_a_cpu_only_machine_runs_from_ram():
    builtin = ModelParts("builtin", 30, 576 * 49153 * 4, 0, 3_600_000, 30, 8, 2, 10_616_832, 2 * 576 * 1536 * 3,
                         2 * 30 * 3 * 64 * 4, 2e7, 576)
    p = plan(builtin, machine(0, ram_gb=16, gpu=False), max_context=8192, max_batch=4,
             kv_shape=(3, 64, torch.float32))
    assert p.fits and p.device == "cpu" and (p.kv_policy, p.expert_policy) == ("resident", "resident")
    assert p.reason.startswith("no GPU") and p.decode_tok_s > 0
    assert {r.where for r in p.rows} == {"RAM"}


def test_a_model_larger_than_vram_and_ram_is_refused_with_sizes_and_remedies():
    full = preset("synthetic:qwen3-30b-a3b")
    p = plan(full, machine(8, ram_gb=32), max_context=40960, max_batch=4)
    assert not p.fits
    assert "57.0 GiB" in p.problem or "56.9 GiB" in p.problem
    assert "quantised" in p.remedy


def test_the_refusal_names_a_context_that_fits():
    p = plan(L16, machine(0, ram_gb=24, gpu=False), max_context=40960, max_batch=4)
    assert not p.fits
    ctx = int(p.remedy.split("at most ")[1].split(" tokens")[0].replace(",", ""))
    assert plan(L16, machine(0, ram_gb=24, gpu=False), max_context=ctx, max_batch=4).fits
    assert not plan(L16, machine(0, ram_gb=24, gpu=False), max_context=ctx + 64, max_batch=4).fits


def test_a_slow_link_and_a_fast_cpu_move_the_misses_to_the_cpu():
    fast_link = plan(L16, machine(8), max_context=2048, max_batch=1)
    slow_link = plan(L16, machine(8, pcie_gbps=2.0, cpu_gbps=200.0, host_gbps=250.0), max_context=2048, max_batch=1)
    assert "PCIe" in fast_link.bottleneck.split(";")[0] or "CPU" in fast_link.bottleneck
    assert slow_link.bottleneck.startswith("decode: CPU experts")


def test_calibrated_costs_change_the_prediction():
    slow = plan(L16, machine(8, cpu_gbps=10.0), max_context=2048, max_batch=1)
    fast = plan(L16, machine(8, cpu_gbps=100.0), max_context=2048, max_batch=1)
    assert fast.decode_tok_s > slow.decode_tok_s


def test_dense_models_have_no_expert_rows():
    config = synthetic.config_for("synthetic:qwen3-30b-a3b-L2")
    args = families.for_model_type(config["model_type"], None).args_from_config(config)
    from dataclasses import replace
    dense = model_parts(replace(args, n_experts=0, top_k=0, expert_ffn_dim=0), 2, "dense")
    p = plan(dense, machine(8), max_context=2048, max_batch=1)
    assert p.expert_policy == "resident" and not any("experts" in r.part for r in p.rows)


def test_cache_and_routing_arithmetic():
    assert unique_experts(128, 8, 1) == pytest.approx(8)
    assert unique_experts(128, 8, 512) == pytest.approx(128, rel=1e-6)  # a prefill chunk touches them all
    assert lru_hit_rate(64, 128, 16) == 0.5
    assert lru_hit_rate(64, 128, 200) == 0.0  # a pass longer than the cache evicts everything first
    p = plan(L16, machine(8), max_context=32768, max_batch=1)
    assert p.decode_tok_s < p.decode_tok_s_short  # the full context reads more KV than its start


def test_spilled_kv_costs_grow_with_context_and_resident_kv_does_not_spill():
    c = machine(8)
    spill = Placement("gpu", "writescope", "resident", 0, 0, 0)
    short, _ = decode_ms(spill, L16, c, 1024, 1, 256)
    long, bound = decode_ms(spill, L16, c, 65536, 1, 256)
    assert long > short and bound == "KV in host memory"


def test_what_the_hybrid_paths_cannot_run_is_never_planned():
    """A model whose attention the hybrid KV cannot honour (sinks, windows) or whose experts the
    offloading executors cannot take (biases, another activation) stays resident, on the CPU if need be."""
    from dataclasses import replace

    fixed = replace(L16, can_spill_kv=False, can_offload_experts=False)
    p = plan(fixed, machine(8), max_context=2048, max_batch=1)
    assert p.fits and (p.device, p.kv_policy, p.expert_policy) == ("cpu", "resident", "resident")
    roomy = plan(fixed, machine(48), max_context=2048, max_batch=1)
    assert (roomy.device, roomy.kv_policy, roomy.expert_policy) == ("gpu", "resident", "resident")


def held(c: MachineCosts, max_context: int) -> placement.Plan:
    return placement.held_chats(lambda n: plan(L16, c, max_context=max_context, max_batch=n))


def test_the_plan_holds_four_chats_where_their_kv_costs_the_chat_in_use_nothing():
    p = held(machine(48), 32768)  # 18 GiB of experts and four 32K chats' KV (4 GiB) fit
    assert p.max_batch == placement.AUTO_CHATS and p.expert_policy == "resident"
    assert "without slowing it" in p.chats_reason and "KV of 4 chats held" in p.summary()
    asked = []
    placement.held_chats(lambda n: asked.append(n) or plan(L16, machine(48), max_context=32768, max_batch=n))
    assert asked == [1, 4]  # fewer chats are planned only when four would cost something


def test_the_plan_holds_fewer_chats_where_their_kv_would_push_experts_off_the_gpu():
    four = plan(L16, machine(22), max_context=32768, max_batch=4)
    assert four.expert_policy == "adaptive"  # the KV of four 32K chats takes slots from the experts
    p = held(machine(22), 32768)
    assert p.max_batch < 4 and p.expert_policy == "resident" and p.kv_policy == "resident"
    assert p.decode_tok_s > 1.2 * four.decode_tok_s
    assert f"to about {four.decode_tok_s:.0f} tok/s" in p.chats_reason and "re-reads its history" in p.chats_reason
    # whatever it holds costs the chat in use no more than HELD_CHAT_COST of its step
    one = plan(L16, machine(22), max_context=32768, max_batch=1)
    assert 1 / p.decode_tok_s <= (1 + placement.HELD_CHAT_COST) / one.decode_tok_s


def test_a_machine_whose_ram_holds_one_long_chat_runs_it_instead_of_refusing_four():
    cpu = machine(0, ram_gb=24, gpu=False)  # 18 GiB of experts + 1 GiB a 32K chat: one fits, four do not
    assert not plan(L16, cpu, max_context=32768, max_batch=4).fits
    p = held(cpu, 32768)
    assert p.fits and p.max_batch in (1, 2) and "does not fit" in p.chats_reason
    # nothing fits at all: the refusal is the one-chat plan's, whose remedy does not ask for fewer chats
    none = held(machine(0, ram_gb=8, gpu=False), 32768)
    assert not none.fits and none.max_batch == 1 and "max_batch" not in none.remedy


@pytest.mark.parametrize("name", ["synthetic:qwen3-30b-a3b-Q4_0", "synthetic:deepseek-v2-lite-Q4_0"])
def test_thirty_two_long_chats_keep_quantised_experts_on_the_gpu_and_spill_the_kv(name):
    """#39's aggregate (32 chats × 32K, 24 GB): the experts as Q4_0 blocks (16 and 8 GB) stay on the GPU,
    and the KV (96 and 30 GiB) is what spills, split by writescope: the bench's `--expert-policy resident`
    beside each KV policy is the plan's own placement."""
    from engine.kv.latent import format_shape
    from engine.runtime.planning import _synthetic_blocks

    config = synthetic.config_for(name)
    args = families.for_model_type(config["model_type"], None).args_from_config(config)
    parts = _synthetic_blocks(model_parts(args, 2, name), name, args)
    assert parts.routed_bytes < 17 * GiB  # the blocks' bytes, not BF16's (57 and 29 GiB)
    p = plan(parts, machine(24, ram_gb=125), max_context=32768 + 64, max_batch=32,
             kv_shape=(*format_shape(args), torch.bfloat16))
    assert p.fits and (p.device, p.kv_policy, p.expert_policy) == ("gpu", "writescope", "resident")
    assert p.ram_bytes >= 32 * 32768 * parts.kv_bytes_per_token  # every chat's KV in host memory
