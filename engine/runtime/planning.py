"""The placement plan of one EngineConfig on this machine, before any weight is read.

Gathers what sched/placement.py decides from — the model's parts from its headers (or a synthetic
preset's config), the VRAM budget (`vram_budget_gb`, else free VRAM less a margin), the RAM
available, and the calibration profile's costs (documented defaults without one) — and turns the
plan into the config that runs: `auto` policies, the device and the expert cache slots resolved.
Explicit policies stay as given (they are how benchmarks compare placements); the plan is still
computed and shown for them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import psutil
import torch

from engine.errors import ConfigError, OutOfMemoryError
from engine.experts.store import QuantLayout
from engine.kernels import quant_linear_gpu
from engine.kv.latent import format_shape
from engine.kv.layer_split import split_windows
from engine.kv.partition import PartitionSpec
from engine.models import synthetic
from engine.models.common import ModelArgs
from engine.models.loader import keeps_expert_blocks
from engine.models.shape import model_args
from engine.models.sizes import model_parts, recurrent_state_bytes
from engine.quant.quantise import CODES
from engine.runtime.expert_placement import costs_from_profile
from engine.runtime.generator import PREFILL_CHUNK
from engine.runtime.kv_setup import kv_dtype, roofline_from_profile
from engine.sched.expert_cost import ExpertCostModel
from engine.sched.placement import AUTO_CHATS, Plan, held_chats, plan
from engine.sched.placement_speed import DEFAULT_CPU_TFLOPS, DEFAULT_DRAM_GBPS, GiB, MachineCosts

log = logging.getLogger("tandem")

# Without a budget: the share of the GPU's free memory the plan may give away; the rest is left to the
# allocator's fragmentation and other programs on the GPU (activations are in the plan's reserve).
FREE_VRAM_USE = 0.9


def _dtype_bytes(config, device_type: str) -> int:
    if config.dtype == "float32":
        return 4
    if config.dtype == "bfloat16" or config.model.startswith("synthetic:"):
        return 2  # synthetic presets are generated in bf16 on any device (runtime/loading.py)
    return 2 if device_type == "cuda" else 4  # auto: bf16 on a GPU, fp32 on the CPU


def _gpu_side(config) -> tuple[bool, bool]:
    """(a GPU side exists, it is simulated on the CPU)."""
    if config.device == "cpu":
        return bool(config.simulate_hybrid), bool(config.simulate_hybrid)
    cuda = torch.cuda.is_available()
    if config.device.startswith("cuda") and not cuda:
        raise ConfigError("device 'cuda' was asked for but no CUDA GPU is available",
                          "use --device cpu (or auto), or install a CUDA build of torch and a driver")
    return cuda or bool(config.simulate_hybrid), not cuda and bool(config.simulate_hybrid)


def machine_costs(config, args: ModelArgs, profile, dtype_bytes: int,
                  expert_bytes_per_weight: float | None = None) -> MachineCosts:
    """expert_bytes_per_weight: what the expert store holds a weight in, where not dtype_bytes (a
    GGUF's quantised experts): the link and the CPU move those bytes."""
    gpu, simulated = _gpu_side(config)
    ram = psutil.virtual_memory().available
    if config.vram_budget_gb:
        vram, source = int(config.vram_budget_gb * GiB), "budget"
    elif gpu and not simulated:
        vram, source = int(torch.cuda.mem_get_info()[0] * FREE_VRAM_USE), "free VRAM"
    elif gpu:  # simulated without a budget: the stand-in GPU is the host itself
        vram, source = ram, "simulated, no budget"
    else:
        vram, source = 0, "no GPU"
    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    experts, kv, dram, cpu_tflops, costs_source = None, None, DEFAULT_DRAM_GBPS, DEFAULT_CPU_TFLOPS, "defaults"
    if profile is not None:
        if args.is_moe:
            experts = costs_from_profile(profile, args.dim, args.expert_ffn_dim, dtype, expert_bytes_per_weight)
        n_kv, head_dim = format_shape(args)  # the shape calibrated and looked up: latent rows as two planes
        kv = roofline_from_profile(profile, replace(args, n_kv_heads=n_kv, head_dim=head_dim), dtype, config.max_batch)
        measured = (profile.data.get("memory") or {}).get("read_GBps")
        if isinstance(measured, (int, float)) and measured > 0:
            dram = float(measured)
        if experts is not None:
            cpu_tflops = experts.cpu_tflops
        costs_source = f"calibrated ({profile.name})"
    if experts is None:
        experts = ExpertCostModel.from_shape(args.dim, max(args.expert_ffn_dim, 1),
                                             expert_bytes_per_weight or dtype_bytes)
    if kv is None:
        kv = PartitionSpec.for_shape(*format_shape(args), dtype, cuda=gpu and not simulated).roofline
    return MachineCosts(gpu=gpu, vram_bytes=vram, ram_bytes=ram, experts=experts, kv=kv, dram_gbps=dram,
                        cpu_tflops=cpu_tflops, budget_source=source, costs_source=costs_source, simulated=simulated)


def placement_plan(config, profile=None) -> Plan:
    """The plan for `config` on this machine (reads the model's headers only). With max_batch None
    the plan also chooses how many chats' KV to hold: the most, up to AUTO_CHATS, that do not slow
    the chat in use (`held_chats`)."""
    plan_for = _planner(config, profile)
    if config.max_batch is not None:
        return plan_for(config.max_batch)
    return held_chats(plan_for)


def _planner(config, profile):
    """chats → the plan of `config` holding that many chats' KV (the model's headers read once)."""
    args = model_args(config.model)
    max_context = min(config.max_context or args.max_position, args.max_position)
    gpu, simulated = _gpu_side(config)
    dev_bytes = _dtype_bytes(config, "cuda" if gpu and not simulated else "cpu")
    cpu_bytes = _dtype_bytes(config, "cpu")
    # what the engine's hybrid paths cannot run for this model (runtime/loading.py and the families refuse
    # it): a model-wide window; per-layer windows keep their layers' KV resident (kv/layer_split.py)
    windows = split_windows(args, max_context) or []
    resident_layers = sum(w is not None for w in windows)
    model_wide = args.layer_windows is None and bool(args.sliding_window and args.sliding_window < max_context)
    can = dict(can_spill_kv=not model_wide and resident_layers < len(args.kv_layer_ids()),
               can_offload_experts=args.expert_act in ("silu", "clamped"), resident_kv_layers=resident_layers)
    parts = replace(model_parts(args, dev_bytes, config.model), **can)
    gguf_auto = config.dtype == "auto" and config.model.lower().endswith(".gguf")
    if not gpu and getattr(args, "mla", None) is None:  # the CPU cache's rows (runtime/kv_setup.py kv_dtype)
        rows = kv_dtype(config, torch.device("cpu"), torch.float32 if cpu_bytes == 4 else torch.bfloat16)
        parts = replace(parts, kv_bytes_per_token=parts.kv_bytes_per_token * rows.itemsize // cpu_bytes)
    if not gpu and gguf_auto:
        parts = _in_blocks(parts, config.model, args, cpu_bytes)  # what the CPU load holds (runtime/loading.py)
    elif gguf_auto and not simulated and quant_linear_gpu.works(_cuda(config)):
        # on a GPU the dense layers keep their blocks (runtime/loading.py), offloaded experts theirs in
        # the host store and the cache slots, resident ones in the device's pool
        parts = _in_blocks(parts, config.model, args, dev_bytes)
    elif gguf_auto and parts.n_experts and keeps_expert_blocks(args.arch, True):
        # the experts keep their blocks in the store and the slots; the dense weights dequantise (the
        # simulated GPU, or a GPU whose kernels over blocks failed), and so do resident experts on such
        # a GPU (the simulated one keeps them in blocks on the CPU)
        held = _in_blocks(parts, config.model, args, cpu_bytes).expert_bytes
        parts = replace(parts, expert_bytes=held) if simulated else replace(parts, store_expert_bytes=held)
    parts = _synthetic_blocks(parts, config.model, args)
    cpu_parts = parts
    if cpu_bytes != dev_bytes:  # a GPU machine's CPU placement loads as a CPU-only engine would
        cpu_parts = _synthetic_blocks(replace(model_parts(args, cpu_bytes, config.model), **can), config.model, args)
        if gguf_auto:
            cpu_parts = _in_blocks(cpu_parts, config.model, args, cpu_bytes)
    per_weight = parts.slot_bytes / (3 * args.dim * args.expert_ffn_dim) if parts.n_experts else None  # store's bytes

    def plan_for(chats: int) -> Plan:
        held = replace(config, max_batch=chats)
        return plan(parts, machine_costs(held, args, profile, dev_bytes, per_weight), max_context=max_context,
                    max_batch=chats,
                    spill_device_bytes=spill_device_bytes(held, args, dev_bytes, max_context, gpu and not simulated),
                    prefill_chunk=PREFILL_CHUNK,
                    d_window=config.d_window, block_size=config.block_size, cpu_parts=cpu_parts)

    return plan_for


def _cuda(config) -> torch.device:
    return torch.device(config.device if config.device.startswith("cuda") else "cuda")


def _in_blocks(parts, path: str, args: ModelArgs, dtype_bytes: int):
    """`parts` sized as the CPU load holds the GGUF: its quantised matrices and experts in blocks at
    their size in the file, the rest dequantised (models/loader.held_bytes)."""
    from engine.models.loader import held_bytes

    held = held_bytes(os.path.expanduser(path), args.arch, dtype_bytes)
    experts = parts.moe_layers * parts.n_experts
    return replace(parts, embed_bytes=held["embed"], output_bytes=held["output"],
                   layer_dense_bytes=held["dense"] // max(parts.n_layers, 1),
                   expert_bytes=held["experts"] // experts if experts else parts.expert_bytes)


def _synthetic_blocks(parts, model: str, args: ModelArgs):
    """A synthetic preset whose routed experts are quantised (`…-Q4_0`): each expert at its blocks'
    bytes, wherever it is kept (store, slots, device pool)."""
    quant = synthetic.expert_quant(model) if model.startswith("synthetic:") else None
    if quant is None or not parts.n_experts:
        return parts
    return replace(parts, expert_bytes=QuantLayout((CODES[quant],) * 3, args.dim, args.expert_ffn_dim).nbytes)


def spill_device_bytes(config, args: ModelArgs, dtype_bytes: int, max_context: int, cuda: bool) -> int:
    """VRAM of writescope's D-window and ping-pong buffers, as kv/partition.py lays them out."""
    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    n_kv, head_dim = format_shape(args)  # latent rows: one head of half a row (engine/kv/latent.py)
    spec = PartitionSpec.for_shape(n_kv, head_dim, dtype, cuda=cuda, block_size=config.block_size,
                                   d_window=config.d_window, max_context=max_context)
    # a hybrid model's recurrent state stays on the device beside the D-windows (its KV row counts it in RAM);
    # the window layers have no D-window (their KV is resident, counted by the planner)
    spilled = len(args.kv_layer_ids()) - sum(w is not None for w in split_windows(args, max_context) or [])
    return spec.device_bytes(spilled, config.max_batch, n_kv, head_dim, dtype) + \
        recurrent_state_bytes(args) * config.max_batch


def apply_plan(config, p: Plan | None):
    """The config that runs: `auto` policies (and the device and slots they imply) and the chats held
    (max_batch None) from the plan. Refuses a model that fits nowhere, with the sizes and what would
    make it fit. Without a plan, `auto` is `resident` (whose KV still turns writescope when it does not
    fit: runtime/kv_setup.py) and AUTO_CHATS chats are held."""
    auto_kv, auto_experts = config.kv_policy == "auto", config.expert_policy == "auto"
    if config.max_batch is None:
        config = replace(config, max_batch=p.max_batch if p is not None else AUTO_CHATS)
    if not (auto_kv or auto_experts):
        return config
    if p is None:
        return replace(config, kv_policy="resident" if auto_kv else config.kv_policy,
                       expert_policy="resident" if auto_experts else config.expert_policy)
    if not p.fits:
        raise OutOfMemoryError(p.problem, p.remedy)
    if p.device == "cpu" and config.device.startswith("cuda"):
        raise OutOfMemoryError(f"the dense weights do not fit the GPU ({p.reason})",
                               "raise vram_budget_gb, or use device auto to run on the CPU")
    changes: dict = {}
    if p.device == "cpu":  # the dense weights do not fit the GPU (or there is none): the CPU computes all
        changes["device"] = "cpu"
        changes["simulate_hybrid"] = False
    if auto_kv:
        changes["kv_policy"] = p.kv_policy
    if auto_experts:
        changes["expert_policy"] = p.expert_policy
        # the slots the plan sized beside its own KV choice (an explicit KV policy re-sizes them at load)
        if p.expert_cache_slots is not None and config.expert_cache_slots is None and auto_kv:
            changes["expert_cache_slots"] = p.expert_cache_slots
    log.info("placement plan: %s", p.summary())
    return replace(config, **changes)
