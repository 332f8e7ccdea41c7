"""Which KV backend a configuration gets, and its partition spec.

`resident` keeps every block on the compute device when it fits; when the KV does not fit the VRAM
budget (`vram_budget_gb`, else the device's free memory) the default becomes `writescope`, the
hybrid that serves spilled KV from both engines. The comparison policies (`gpu-centric`,
`cpu-centric`, `fixed:<r>`, `monolithic`) run in the same runtime with the same kernels.

Hybrid policies need a GPU; `simulate_hybrid` runs them on a CPU-only machine with the "GPU side"
on CPU tensors and synchronous copies (tests, CI). The online estimators of A, B, Δ start from the machine profile
(`tandem calibrate`) when it measured this attention shape; otherwise, on a GPU, from the backend's
own kernels timed at setup (engine/kv/cost_probe.py); on a CPU-only machine from the profile scaled
from the nearest shape, or the documented defaults of `PartitionSpec.for_shape`.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from engine.errors import ConfigError, OutOfMemoryError, TandemError
from engine.hw.shapes import KVShape, dtype_name
from engine.kv.backend import KVBackend
from engine.kv.cost_probe import measure_costs
from engine.kv.inplace import PartitionSpec
from engine.kv.latent import LatentResidentKV, LatentWriteScopeKV, format_shape
from engine.kv.layer_split import LayerSplitKV, split_windows
from engine.kv.monolithic import MonolithicKV
from engine.kv.recurrent import RecurrentKV
from engine.kv.resident import ResidentKV
from engine.kv.writescope import WriteScopeKV
from engine.sched.roofline import RooflineParams

# Without a budget: the share of free device memory resident KV may take; the rest is for the step's
# activations, the allocator's fragmentation and other programs on the GPU.
FREE_MEMORY_USE = 0.85


def resident_kv_bytes(n_layers: int, n_kv: int, head_dim: int, max_context: int, max_batch: int,
                      block_size: int, dtype: torch.dtype) -> int:
    slots = -(-max_context // block_size) * block_size * max_batch
    return 2 * n_layers * slots * n_kv * head_dim * torch.empty((), dtype=dtype).element_size()


def device_weights_bytes(model, experts, device: torch.device) -> int:
    """Weights on the compute device (in simulate mode the CPU stands in for it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == device.type)
    if experts is not None:  # resident experts sit on the device; an offloading executor reports its cache
        tel = experts.telemetry()
        total += tel.get("cache_bytes") or (tel.get("bytes", 0) if experts.policy == "resident" else 0)
    return total


def check_weights_fit(config, device: torch.device, weights_bytes: int) -> None:
    """The weights that live on the device must fit the VRAM budget before any KV is placed there
    (a budget only binds where a device side exists: CUDA, or the simulated hybrid)."""
    if not config.vram_budget_gb or not (device.type == "cuda" or config.simulate_hybrid):
        return
    budget = int(config.vram_budget_gb * 2**30)
    if weights_bytes > budget:
        offload = "" if config.expert_policy != "resident" else ", or offload the experts of an MoE model " \
                                                                 "(expert_policy adaptive)"
        raise OutOfMemoryError(
            f"the weights kept on the GPU need {_size(weights_bytes)}, more than the VRAM budget of "
            f"{_size(budget)} (vram_budget_gb={config.vram_budget_gb:g})",
            f"raise vram_budget_gb to at least {weights_bytes * 1.1 / 2**30:.3g}, choose a smaller model{offload}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def choose_policy(config, device: torch.device, resident_bytes: int, weights_bytes: int) -> str:
    policy = config.kv_policy
    if policy != "resident" or not (device.type == "cuda" or config.simulate_hybrid):
        return policy
    if config.vram_budget_gb:
        room = config.vram_budget_gb * 2**30 - weights_bytes
    elif device.type == "cuda":
        room = torch.cuda.mem_get_info(device)[0] * FREE_MEMORY_USE
    else:
        return policy
    if resident_bytes > room:
        print(f"the KV cache ({resident_bytes / 2**30:.2f} GiB) does not fit the VRAM budget: "
              "kv_policy writescope", file=sys.stderr)
        return "writescope"
    return policy


def roofline_from_profile(profile, args, dtype: torch.dtype, batch: int, *,
                          measured_only: bool = False) -> RooflineParams | None:
    """A, B, Δ (and C_CPU) calibrated on this machine for this attention shape (scaled by bytes per
    token from the nearest calibrated one, unless measured_only); None without a profile or KV
    measurements, or when the profile has no GPU side (a CPU-only machine)."""
    if profile is None:
        return None
    try:
        costs = profile.kv_costs(KVShape(args.n_heads, args.n_kv_heads, args.head_dim, dtype_name(dtype)), batch)
    except TandemError:
        return None
    if costs.B_ns_per_token is None or costs.delta_ms is None or (measured_only and costs.source != "measured"):
        return None
    return RooflineParams(costs.A_ns_per_token, costs.B_ns_per_token, costs.delta_ms, costs.C_cpu_ms)


def _start_costs(kv: WriteScopeKV, profile, args, dtype: torch.dtype, batch: int) -> WriteScopeKV:
    """Start kv's estimators from the profile's costs for this very shape; failing that, on a GPU,
    from its own kernels timed now (engine/kv/cost_probe.py: a prompt's KV is placed by the costs known
    when it arrives, and a shape scaled by bytes or a bandwidth default can be far from them); else
    from the profile scaled from the nearest shape, or the defaults."""
    cuda = kv.transport.cuda
    params = roofline_from_profile(profile, args, dtype, batch, measured_only=cuda)
    if params is not None:
        kv.calibrate(params, "calibration profile")
    elif cuda:
        try:
            kv.calibrate(measure_costs(kv, args.n_heads), "measured at setup")
        except (TandemError, RuntimeError) as e:  # no page-locked or device memory for it: not worth a failed load
            print(f"WriteScope's costs could not be measured at setup ({e}); it starts from the defaults, "
                  "which its decode steps correct", file=sys.stderr)
    return kv


def build_kv(config, args, model, experts, device: torch.device, dtype: torch.dtype, max_context: int, *,
             sliding_window: int | None = None, profile=None) -> KVBackend:
    """The KV backend of `config.kv_policy` (resident turns into writescope when it does not fit).
    profile: the machine's calibration (engine.hw.profile.MachineProfile) or None. A hybrid model's
    KV covers its full-attention layers only, with the recurrent layers' state kept beside it."""
    kv = _build_attention_kv(config, args, model, experts, device, dtype, max_context,
                             sliding_window=sliding_window, profile=profile)
    n_recurrent = args.n_layers - len(args.kv_layer_ids())
    if not n_recurrent:
        return kv
    shape = args.linear_attn  # DeltaNetShape: (conv (C, K−1), state (nv, dk, dv)) per sequence and layer
    rows = ((shape.conv_dim, shape.conv_kernel - 1), (shape.n_v_heads, shape.k_head_dim, shape.v_head_dim))
    return RecurrentKV(kv, n_recurrent, rows, device, max_rows=config.max_batch)


def kv_dtype(config, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The resident cache's rows: fp16 on the CPU under dtype auto (fp32 compute), as llama.cpp's default
    cache. A decode step reads every row of its chat, so at long contexts the KV's bytes are most of a CPU
    step: fp16 halves them and the RAM they take, and the attention still sums in fp32. An explicit
    float32 keeps fp32 rows (the reference the parity tests hold to transformers); GPUs keep `dtype`."""
    if device.type == "cpu" and config.dtype == "auto" and dtype == torch.float32:
        return torch.float16
    return dtype


def _build_attention_kv(config, args, model, experts, device: torch.device, dtype: torch.dtype, max_context: int,
                        *, sliding_window: int | None, profile) -> KVBackend:
    n_layers = len(args.kv_layer_ids())
    shape = dict(n_layers=n_layers, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim)
    mla = getattr(args, "mla", None)
    rows = dtype if mla is not None else kv_dtype(config, device, dtype)  # the latent cache keeps the model's
    resident_bytes = resident_kv_bytes(n_layers, args.n_kv_heads, args.head_dim, max_context,
                                       config.max_batch, config.block_size, rows)
    if mla is not None:
        resident_bytes //= 2  # K-only rows: the values are the latent columns of the keys
    check_weights_fit(config, device, device_weights_bytes(model, experts, device))
    policy = choose_policy(config, device, resident_bytes, device_weights_bytes(model, experts, device))
    if mla is not None:
        room = None if not config.vram_budget_gb else \
            int(config.vram_budget_gb * 2**30) - device_weights_bytes(model, experts, device)
        return _latent_kv(config, args, policy, device, dtype, max_context, room, profile)
    windows = split_windows(args, max_context)
    if policy == "resident" or (windows is not None and None not in windows):  # every layer windowed: small KV
        return ResidentKV(n_layers, args.n_kv_heads, args.head_dim, max_context=max_context,
                          max_batch=config.max_batch, block_size=config.block_size, device=device, dtype=rows,
                          sliding_window=sliding_window)
    _check_hybrid_device(config, policy, device)
    window_kv = None
    if windows is not None:  # the window layers' KV stays resident; the hybrid part holds the full layers
        n_window = sum(w is not None for w in windows)
        window_kv = ResidentKV(n_window, args.n_kv_heads, args.head_dim, max_context=max_context,
                               max_batch=config.max_batch, block_size=config.block_size, device=device,
                               dtype=dtype)
        shape["n_layers"] = n_layers - n_window
    room = None
    if config.vram_budget_gb:
        room = int(config.vram_budget_gb * 2**30) - device_weights_bytes(model, experts, device)
        if window_kv is not None:
            room -= window_kv.telemetry()["bytes"]["kv_resident"]
    hybrid = _hybrid_kv(config, args, policy, shape, device, dtype, max_context, room, profile)
    return hybrid if window_kv is None else LayerSplitKV(windows, max_context, window_kv, hybrid)


def _hybrid_kv(config, args, policy: str, shape: dict, device: torch.device, dtype: torch.dtype,
               max_context: int, room: int | None, profile) -> KVBackend:
    """The backend of a hybrid policy over `shape`'s layers; room: device bytes its regions may take."""
    if policy == "monolithic":
        return MonolithicKV(**shape, max_context=max_context, max_batch=config.max_batch, device=device, dtype=dtype)
    spec = PartitionSpec.for_shape(args.n_kv_heads, args.head_dim, dtype, cuda=device.type == "cuda",
                                   block_size=config.block_size, d_window=config.d_window,
                                   max_context=max_context, vram_budget_bytes=room)
    kv = WriteScopeKV(**shape, max_context=max_context, max_batch=config.max_batch, device=device,
                      dtype=dtype, spec=spec, policy=policy)
    return _start_costs(kv, profile, args, dtype, config.max_batch)


def _check_hybrid_device(config, policy: str, device: torch.device) -> None:
    """A hybrid KV policy needs a GPU beside the CPU (or simulate_hybrid, which plays its part)."""
    if device.type != "cuda" and not config.simulate_hybrid:
        raise ConfigError(f"kv_policy '{policy}' splits attention between a GPU and the CPU, but the compute "
                          f"device is {device}", "use kv_policy resident (or simulate_hybrid to test the hybrid path)")


def _latent_kv(config, args, policy: str, device: torch.device, dtype: torch.dtype, max_context: int,
               room: int | None, profile) -> KVBackend:
    """Multi-head latent attention (DeepSeek-V2) caches one [latent, RoPE key] row per token: resident
    rows, the hybrid format holding each row in its two planes (engine/kv/latent.py), or the
    monolithic comparison's buffers of rows."""
    mla = args.mla
    if policy == "resident":
        return LatentResidentKV(args.n_layers, mla.row_width, mla.kv_lora_rank, max_context=max_context,
                                max_batch=config.max_batch, block_size=config.block_size, device=device, dtype=dtype)
    _check_hybrid_device(config, policy, device)
    if policy == "monolithic":  # the comparison policy's one pinned buffer, of rows (engine/kv/latent_monolithic.py)
        from engine.kv.latent_monolithic import LatentMonolithicKV

        return LatentMonolithicKV(args.n_layers, mla.row_width, mla.kv_lora_rank, max_context=max_context,
                                  max_batch=config.max_batch, device=device, dtype=dtype)
    n_kv, plane = format_shape(args)
    spec = PartitionSpec.for_shape(n_kv, plane, dtype, cuda=device.type == "cuda", block_size=config.block_size,
                                   d_window=config.d_window, max_context=max_context, vram_budget_bytes=room)
    kv = LatentWriteScopeKV(args.n_layers, mla.row_width, mla.kv_lora_rank, max_context=max_context,
                            max_batch=config.max_batch, device=device, dtype=dtype, spec=spec, policy=policy)
    return _start_costs(kv, profile, replace(args, n_kv_heads=n_kv, head_dim=plane), dtype, config.max_batch)
