"""The planner's count of GLM-4.5-Air's bytes: the shared expert and the router's correction bias
are dense weights (every token reads them), counted with the layer on the GPU side; only the
routed experts are offloadable blocks."""

import inspect

import pytest

from engine.models import families, synthetic
from engine.models.sizes import model_parts
from engine.sched import placement
from engine.sched.expert_cost import ExpertCostModel
from engine.sched.placement import GiB, MachineCosts
from engine.sched.roofline import RooflineParams


def parts(name: str):
    config = synthetic.config_for(name)
    args = families.for_model_type(config["model_type"], None).args_from_config(config)
    return args, model_parts(args, 2, name)


def test_glm_shared_expert_counts_as_dense_layer_bytes():
    args, p = parts("synthetic:glm-4.5-air")
    H, I = 4096, 1408
    attention = H * 96 * 128 + 2 * H * 8 * 128 + 96 * 128 * H + 2 * H + (96 + 16) * 128  # q/k/v biases, no o bias
    moe_layer = attention + 128 * H + 128 + 3 * H * I  # router, correction bias, shared expert
    dense_layer = attention + 3 * H * 10944
    assert p.layer_dense_bytes == (dense_layer + 45 * moe_layer) // 46 * 2
    assert p.expert_bytes == 3 * H * I * 2 and p.n_routed == 45 * 128  # the shared expert is not a routed block
    assert p.moe_layers == 45 and p.top_k == 8
    total = p.embed_bytes + p.output_bytes + 46 * p.layer_dense_bytes + p.routed_bytes
    assert total / 2 / 1e9 == pytest.approx(106.85, abs=0.01)  # every parameter counted once


def test_planner_keeps_glm_shared_experts_on_the_gpu():
    """24 GiB of VRAM: the dense part (shared experts included) on the GPU, the routed experts cached."""
    _, p = parts("synthetic:glm-4.5-air-L8")
    kv = RooflineParams(A_ns_per_token=4096 / 10.0, B_ns_per_token=4096 / 25.0, delta_ms=0.1)
    costs = MachineCosts(gpu=True, vram_bytes=24 * GiB, ram_bytes=128 * GiB,
                         experts=ExpertCostModel.from_shape(4096, 1408, 2), kv=kv, dram_gbps=90.0)
    extra = {"prefill_chunk": 512} if "prefill_chunk" in inspect.signature(placement.plan).parameters else {}
    plan = placement.plan(p, costs, max_context=2048, max_batch=1, spill_device_bytes=0, **extra)
    assert plan.fits and plan.device == "gpu" and plan.expert_policy != "resident"
    shared = 7 * 3 * 4096 * 1408 * 2  # the shared experts of layers 1-7
    assert p.dense_bytes > shared and plan.vram_bytes >= p.dense_bytes


def test_gpt_oss_sinks_and_biases_count_as_dense_layer_bytes():
    args, p = parts("synthetic:gpt-oss-20b")
    H, I, E = 2880, 2880, 32
    q, kv = 64 * 64, 8 * 64
    attention = 2 * H * q + 2 * H * kv + 2 * H + (q + 2 * kv) + H + 64  # projections, norms, biases, sinks
    layer = attention + E * H + E + E * (2 * I + H)  # router and its bias, the experts' biases
    assert p.layer_dense_bytes == layer * 2
    assert p.expert_bytes == 3 * H * I * 2 and p.n_routed == 24 * E
    total = p.embed_bytes + p.output_bytes + 24 * p.layer_dense_bytes + p.routed_bytes
    assert total / 2 / 1e9 == pytest.approx(20.91, abs=0.01)
