"""Placing offloaded experts at load: the host store, the cache size from the VRAM budget, the
lookahead predictor, and the warm-up from the hot-expert table.

Called by `loading.load_parts` for every expert policy but `resident`. The cache gets what the
budget leaves after the dense weights, the KV regions on the device and a reserve for activations:

    slots = (vram_budget − dense weights − device KV − reserve) / expert block bytes

(`expert_cache_slots` overrides it). Without a budget the CUDA device's free memory stands in for
it; a simulated hybrid run on the CPU without either keeps half of the experts.
"""

from __future__ import annotations

import logging

import torch

from engine.errors import ConfigError, TandemError
from engine.experts.cache import slots_for_budget
from engine.experts.offload import OFFLOAD_POLICIES, OffloadedExperts
from engine.experts.predictor import GateLookahead, HotTable, default_hot_table_path, even_spread
from engine.experts.store import ExpertStore
from engine.hw.shapes import ExpertShape, dtype_name
from engine.quant.blocks import QuantStack
from engine.sched.expert_cost import ExpertCostModel

log = logging.getLogger(__name__)

RESERVE_BYTES = 1 << 30  # activations, grouped-GEMM intermediates, allocator slack on the device


def check_offload(policy: str, device: torch.device, simulate_hybrid: bool) -> bool:
    """True when experts are offloaded; refuses an offload policy on a CPU-only engine unless the
    hybrid path is simulated."""
    if policy == "resident":
        return False
    if policy not in OFFLOAD_POLICIES:
        raise ConfigError(f"unknown expert_policy '{policy}'", f"use resident or one of {', '.join(OFFLOAD_POLICIES)}")
    if device.type == "cpu" and not simulate_hybrid:
        raise ConfigError(f"expert_policy '{policy}' splits experts between a GPU and the CPU, and this engine "
                          "runs on the CPU only", "use expert_policy resident (or simulate_hybrid to test the path)")
    return True


def costs_from_profile(profile, hidden: int, expert_ffn: int, dtype: torch.dtype,
                       bytes_per_weight: float | None = None) -> ExpertCostModel | None:
    """The expert cost model with this machine's calibration (the nearest calibrated expert shape,
    scaled by bytes); None without a profile or usable expert measurements: the documented defaults
    (the load goes on; a profile is advice, and a damaged one is reported, not fatal).
    bytes_per_weight: what the store holds an expert in (quantised blocks), if not `dtype`."""
    if profile is None:
        return None
    try:
        costs = profile.expert_costs(ExpertShape(hidden, expert_ffn, dtype_name(dtype)))
        beside = (costs.concurrent or {}).get("B_H_GBps")  # the CPU's rate while fills stream
        return ExpertCostModel.from_calibration(hidden, expert_ffn,
                                                bytes_per_weight or torch.empty((), dtype=dtype).element_size(),
                                                costs.cpu_ms_by_tokens, costs.B_P_GBps, beside)
    except TandemError:
        return None
    except (ValueError, TypeError, KeyError) as e:  # zero, negative or missing numbers
        log.warning("the calibration profile's expert costs are unusable (%s): planning with the defaults; "
                    "run `tandem calibrate` again", e)
        return None


def build_offloaded(policy: str, gate_up, down, *, device: torch.device, dtype: torch.dtype,
                    max_decode_tokens: int, profile=None) -> OffloadedExperts:
    """The store (pinned when the device is a GPU) and the executor; the cache opens later. gate_up,
    down: per layer tensors, or QuantStacks (a GGUF's experts, then stored in their blocks). profile:
    the calibration whose expert costs the executor plans with, at the store's bytes per weight
    (None, or none usable: the documented defaults)."""
    quantised = any(isinstance(t, QuantStack) for t in gate_up)
    store = (ExpertStore.from_quant_layers if quantised else ExpertStore.from_layers)(
        gate_up, down, dtype=dtype, pin=device.type == "cuda")
    gate_up.clear()  # the store holds the weights now; drop the loader's references
    down.clear()
    costs = costs_from_profile(profile, store.hidden, store.expert_ffn, dtype,
                               store.block_bytes / store.weights_per_expert)
    return OffloadedExperts(policy, store, device=device, max_decode_tokens=max_decode_tokens, costs=costs)


def _device_kv_bytes(kv) -> int:
    regions = kv.telemetry().get("bytes", {})
    return sum(regions.get(r) or 0 for r in ("kv_resident", "kv_dwindow", "kv_pingpong"))


def cache_slots(config, device: torch.device, executor: OffloadedExperts, used_bytes: int) -> int:
    if config.expert_cache_slots is not None:
        if config.expert_cache_slots < 0:
            raise ConfigError("expert_cache_slots must be ≥ 0", "pass a slot count, or leave it unset")
        return int(config.expert_cache_slots)
    slot_bytes = executor.store.slot_bytes
    if config.vram_budget_gb:
        budget = int(config.vram_budget_gb * 2**30)
        return slots_for_budget(budget, used_bytes, slot_bytes, min(RESERVE_BYTES, budget // 10))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return slots_for_budget(free, 0, slot_bytes, RESERVE_BYTES)
    return executor.store.n_routed // 2


def open_offloaded(executor: OffloadedExperts, model, kv, config, device: torch.device, dense_bytes: int) -> None:
    """Size and open the cache, attach the lookahead predictor, warm the cache."""
    used = dense_bytes + _device_kv_bytes(kv) if device.type == "cuda" or config.vram_budget_gb else 0
    executor.open_cache(cache_slots(config, device, executor, used))
    moe = [(i, layer.mlp) for i, layer in enumerate(model.model.layers)
           if getattr(layer.mlp, "experts", None) is executor]
    if executor.planner.prefetches and moe:
        # keyed by the executor's layer index (MoE layers only): a model with dense layers (GLM's
        # first, Qwen's mlp_only_layers) numbers its decoder layers differently
        routers = {mlp.expert_layer: mlp.gate.weight for _, mlp in moe}  # (E, H) each, already on the device
        executor.attach_predictor(GateLookahead(routers, moe[0][1].route, moe[0][1].top_k))
    if executor.cache is None:
        return
    n = executor.cache.n_slots
    path = default_hot_table_path(config.model)
    table = None
    if path.is_file():
        try:
            table = HotTable.load(path)
        except (OSError, ValueError, KeyError):
            table = None  # an unreadable table only costs the warm start
        if table is not None and table.counts.shape != executor.trace.counts.shape:
            table = None
    if table is not None:
        executor.warm(table.top(n), source=str(path))
    else:
        executor.warm(even_spread(executor.store.layers, executor.store.n_experts, n), source="even-spread")


def switch_expert_policy(parts, config, policy: str) -> OffloadedExperts:
    """Replace an engine's offloaded executor by one of another offload policy over the same host
    store, without reloading the model: the old slots are freed first, then the new cache is sized
    and warmed as at load. (Benchmarks compare policies this way; `resident` needs a reload.)"""
    old = parts.experts
    if not isinstance(old, OffloadedExperts):
        raise ConfigError("only an engine loaded with an offload expert policy can switch policies",
                          f"load it with expert_policy one of {', '.join(OFFLOAD_POLICIES)}")
    if policy not in OFFLOAD_POLICIES:
        raise ConfigError(f"cannot switch to expert_policy '{policy}'", f"use one of {', '.join(OFFLOAD_POLICIES)}")
    old.close(release_store=False)
    old.cache = None  # the slot pool goes with the last reference to it
    new = OffloadedExperts(policy, old.store, device=old.device, costs=old.costs,
                           max_decode_tokens=old.planner.max_decode_tokens, cpu_ffn=old.cpu_ffn,
                           cpu_kernel=old.cpu_kernel)
    for layer in parts.model.model.layers:
        if getattr(layer.mlp, "experts", None) is old:
            layer.mlp.experts = new
    parts.experts = new
    del old
    if parts.device.type == "cuda":
        torch.cuda.empty_cache()
    open_offloaded(new, parts.model, parts.kv, config, parts.device, parts.weights_bytes)
    return new
