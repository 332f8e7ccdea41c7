"""From a model name to placed parts: device and dtype, weights, expert executor, KV backend, tokenizer."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.errors import ConfigError, OutOfMemoryError, UnsupportedModelError
from engine.experts.executor import ExpertExecutor
from engine.kernels import native, quant_linear_gpu
from engine.kv.backend import KVBackend
from engine.models import builtin, families, synthetic
from engine.models.assemble import assemble
from engine.models.common import Decoder, ModelArgs
from engine.models.loader import load_checkpoint
from engine.quant.experts import resident_experts
from engine.runtime.chat import load_tokenizer
from engine.runtime.expert_placement import build_offloaded, check_offload, open_offloaded
from engine.runtime.kv_setup import build_kv

KV_POLICIES = ("resident", "writescope", "gpu-centric", "cpu-centric", "monolithic")  # and fixed:<r>
EXPERT_POLICIES = ("resident", "adaptive", "cpu-only", "on-demand", "static")


@dataclass
class Parts:
    args: ModelArgs
    family: str
    model: Decoder
    kv: KVBackend
    experts: ExpertExecutor | None
    tokenizer: object | None
    device: torch.device
    dtype: torch.dtype
    max_context: int
    weights_bytes: int
    load_s: float | None = None  # wall time from the name to placed weights and KV


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but no CUDA GPU is available",
                          "use --device cpu (or auto), or install a CUDA build of torch and a driver")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ConfigError(f"unknown device '{name}'", "use auto, cuda or cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in table:
        raise ConfigError(f"unknown dtype '{name}'", "use auto, float32 or bfloat16")
    return table[name]


def check_policies(kv_policy: str, expert_policy: str) -> None:
    if kv_policy.startswith("fixed:"):
        try:
            r = float(kv_policy.split(":", 1)[1])
        except ValueError:
            r = -1.0
        if not 0.0 <= r <= 1.0:
            raise ConfigError(f"kv_policy '{kv_policy}' needs a CPU share between 0 and 1", "e.g. fixed:0.3")
    elif kv_policy not in KV_POLICIES:
        raise ConfigError(f"unknown kv_policy '{kv_policy}'", f"use one of {', '.join(KV_POLICIES)} or fixed:<r>")
    if expert_policy not in EXPERT_POLICIES:
        raise ConfigError(f"unknown expert_policy '{expert_policy}'", f"use one of {', '.join(EXPERT_POLICIES)}")


def load_parts(config, progress: Callable[[str, float], None] | None = None, profile=None) -> Parts:
    t_start = time.perf_counter()
    report = progress or (lambda step, frac: None)
    check_policies(config.kv_policy, config.expert_policy)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    offload = check_offload(config.expert_policy, device, config.simulate_hybrid)
    if config.cpu_threads:
        torch.set_num_threads(int(config.cpu_threads))
        native.set_threads(int(config.cpu_threads))  # the native CPU kernels follow the same setting
    elif device.type == "cuda":
        native.set_threads(max(1, native.available_cores() - 1))  # a core of its own for the GPU-driving thread

    report("reading model file", 0.0)
    upcycle = None
    if config.model.startswith("builtin:"):
        path, upcycle = builtin.resolve(config.model)
    elif config.model.startswith("synthetic:"):
        path = config.model
    else:
        path = os.path.expanduser(config.model)
    # a user's GGUF on a GPU keeps its blocks there (its kernels read them; the built-in model keeps
    # its float path, the reference it is held to): the dense layers' and the routed experts'
    file_on_gpu = config.dtype == "auto" and device.type == "cuda" and \
        not config.model.startswith(("synthetic:", "builtin:")) and quant_linear_gpu.works(device)
    if config.model.startswith("synthetic:"):  # random weights generated where they will stay
        if config.dtype == "auto":
            dtype = torch.bfloat16  # the published models' dtype, on any device
        report("generating random weights", 0.1)
        try:
            ckpt = synthetic.load(config.model, device=device, dtype=dtype)
        except torch.OutOfMemoryError as e:
            raise OutOfMemoryError(f"{config.model} does not fit in the memory of {device} ({e})",
                                   "choose fewer layers (-L<n>) or a device with more memory") from e
    else:
        # dtype auto: GGUF's matrices of engine/quant's types stay blocks where kernels take them: all
        # of them on a CPU-only engine and on a GPU (the dense layers' blocks copied to the device, the
        # routed experts in the offloaded experts' host store and cache slots, or the resident experts'
        # device pool); the simulated GPU's dense weights dequantise. Explicit dtypes dequantise everything.
        auto = config.dtype == "auto"
        dense_blocks = (auto and device.type == "cpu" and not offload) or file_on_gpu
        ckpt = load_checkpoint(path, dtype, quantised=dense_blocks, expert_blocks=auto and (offload or file_on_gpu))
    family = families.get(ckpt.family)
    args = family.args_from_config(ckpt.config)
    tensors = ckpt.tensors
    family_name, tokenizer_dir, gguf_file = ckpt.family, ckpt.tokenizer_dir, ckpt.gguf_file
    if upcycle is not None:
        args, tensors = builtin.upcycle_to_moe(args, tensors, upcycle)
    max_context = min(config.max_context or args.max_position, args.max_position)

    report("placing weights", 0.5)
    holder: dict = {}

    def make_experts(gate_up, down):
        if offload:
            holder["experts"] = build_offloaded(config.expert_policy, gate_up, down, device=device, dtype=dtype,
                                                max_decode_tokens=config.max_batch, profile=profile)
        else:  # over blocks where they came placed as blocks (engine/models/assemble.py place_tensor)
            holder["experts"] = resident_experts(gate_up, down, device, dtype)
        return holder["experts"]

    try:
        model = assemble(args, tensors, family.route, source=str(path), device=device, dtype=dtype,
                         make_experts=make_experts, place_experts=not offload)
        del tensors, ckpt  # the model holds what it uses
        report("allocating KV cache", 0.8)
        window = args.sliding_window if args.sliding_window and args.sliding_window < max_context else None
        kv = build_kv(config, args, model, holder.get("experts"), device, dtype, max_context,
                      sliding_window=window, profile=profile)
        if window is not None and not getattr(kv, "supports_sliding_window", False):
            raise UnsupportedModelError(
                f"{config.model} attends within a sliding window of {window} tokens, which kv_policy "
                f"'{kv.policy}' does not implement", f"use kv_policy resident, or max_context ≤ {window}")
    except torch.OutOfMemoryError as e:
        raise OutOfMemoryError(f"{config.model} does not fit in the memory of {device} ({e})",
                               "choose a smaller model or max_context, or a device with more memory") from e
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if offload and holder.get("experts") is not None:
        report("placing experts", 0.85)
        open_offloaded(holder["experts"], model, kv, config, device, weights_bytes)

    report("loading tokenizer", 0.9)
    tokenizer = load_tokenizer(tokenizer_dir, gguf_file) if tokenizer_dir else None
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # generated weights are ready only when their kernels are done
    report("ready", 1.0)
    return Parts(args, family_name, model, kv, holder.get("experts"), tokenizer, device, dtype,
                 max_context, weights_bytes, load_s=time.perf_counter() - t_start)

