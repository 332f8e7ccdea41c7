"""Measure this machine for one model shape and return a profile (profile.py writes it).

    data = calibrate(shape, mode="quick", progress=lambda step, frac: …, cancel=threading.Event())

Steps: probe → DRAM bandwidth → (CUDA) H2D/D2H curves and pin cost → CPU attention cost A and
C_CPU → (CUDA) streamed GPU attention cost B and C_GPU, Δ → expert costs and B_P/B_H/B_R. Each
number is the median of repeated runs after warm-up. `quick` (the first-run default) keeps every
working set small enough to finish in well under a minute on a 2-core machine; `full` measures
the whole 64 KiB–64 MiB transfer curve, two batch sizes and long contexts. Without CUDA the
profile is CPU-only: every GPU field is None with the reason. Cancelling (the event, or an
exception from the progress callback) stops between measurements and returns nothing.
"""

from __future__ import annotations

import datetime as _dt
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import psutil
import torch

from engine.hw import bandwidth, expert_costs, kv_costs, split_check
from engine.hw.attention_kernels import DEFAULT_GPU, ENGINE_CPU, NamedKernel, pick
from engine.hw.probe import fingerprint, mark_unavailable, probe
from engine.hw.profile import SCHEMA, SCHEMA_VERSION
from engine.hw.shapes import ModelShape
from engine.hw.timing import CalibrationCancelled, GPU, Progress
from engine.kernels import attention_cpu, experts_cpu, native
from engine.kernels.experts_torch import expert_ffn

KiB, MiB, GiB = 2**10, 2**20, 2**30
FALLBACK_L3 = 32 * MiB  # when the cache size cannot be read


@dataclass(frozen=True)
class Plan:
    """How much to measure: sizes, repeats, and how long the concurrency run lasts."""

    mode: str
    warmup: int
    repeats: int
    dram_bytes: int
    transfer_sizes: tuple[int, ...]
    pin_bytes: int
    kv_batches: tuple[int, ...]
    kv_lengths: tuple[int, ...]  # tokens per sequence
    pingpong_tokens: int  # tokens per streamed chunk (one ping-pong buffer)
    expert_tokens: tuple[int, ...]  # tokens per expert
    concurrency_ms: float
    split_check_lengths: tuple[int, ...] = ()  # L of the r(L) check (CUDA only; empty: skipped)
    split_check_batch: int = 1


PLANS = {
    "quick": Plan("quick", warmup=2, repeats=7, dram_bytes=128 * MiB,
                  transfer_sizes=(64 * KiB, 1 * MiB, 8 * MiB, 64 * MiB), pin_bytes=64 * MiB,
                  kv_batches=(1,), kv_lengths=(1024, 4096, 16384), pingpong_tokens=4096,
                  expert_tokens=(1, 4, 16, 64), concurrency_ms=100.0),
    "full": Plan("full", warmup=3, repeats=11, dram_bytes=1 * GiB,
                 transfer_sizes=tuple(64 * KiB * 2**i for i in range(11)), pin_bytes=256 * MiB,
                 kv_batches=(1, 4), kv_lengths=(1024, 4096, 16384, 32768), pingpong_tokens=4096,
                 expert_tokens=(1, 2, 4, 8, 16, 32, 64, 128, 256), concurrency_ms=300.0,
                 split_check_lengths=(4096, 16384, 32768), split_check_batch=4),
}


ENGINE_CPU_EXPERT = NamedKernel("engine", experts_cpu.expert_ffn)


@dataclass
class Kernels:
    """The kernels whose costs are measured: on the CPU the ones the engine runs ("engine": the native
    kernels where built, else torch), so that the costs the engine plans with are its own; pass others
    to calibrate them instead. Each is (name, callable); see attention_kernels and expert_costs."""

    cpu_attention: NamedKernel = ENGINE_CPU
    gpu_attention: NamedKernel = DEFAULT_GPU
    cpu_expert: NamedKernel = field(default_factory=lambda: ENGINE_CPU_EXPERT)
    gpu_expert: NamedKernel = field(default_factory=lambda: NamedKernel("torch-expert-ffn", expert_ffn))


KV_PASSES = 2  # each attention step size is timed this many times apart; the fastest median counts (kv_costs.fastest)


def _threads(kernel_name: str) -> int:
    """The threads a CPU kernel ran on: the native kernels' own setting, else torch's."""
    return native.threads() if kernel_name.startswith("native") else torch.get_num_threads()


def plan_for(mode: str) -> Plan:
    if mode not in PLANS:
        from engine.errors import ConfigError

        raise ConfigError(f"unknown calibration mode '{mode}'", f"use one of {', '.join(PLANS)}")
    return PLANS[mode]


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _load_average() -> float | None:
    """1-minute load average (runnable threads), or None where the system has none."""
    try:
        return round(psutil.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _fits(nbytes: int, share: float = 0.25) -> bool:
    """Whether a working set of nbytes leaves most of the available host memory free."""
    return nbytes <= share * psutil.virtual_memory().available


def calibrate(shape: ModelShape, mode: str = "quick", progress: Callable[[str, float], None] | None = None,
              cancel: threading.Event | None = None, kernels: Kernels | None = None,
              use_cuda: bool | None = None, plan: Plan | None = None) -> dict:
    """Measure the machine for `shape` and return the profile dict (nothing is written here).
    `plan` replaces the mode's sizes (tools and tests)."""
    plan = plan or plan_for(mode)
    kernels = kernels or Kernels()
    cuda = torch.cuda.is_available() if use_cuda is None else (use_cuda and torch.cuda.is_available())
    no_gpu = ("no CUDA device is available" if not torch.cuda.is_available()
              else "calibration was asked to skip the GPU")
    # Step weights (rough expected time) in the order the steps run, so the fraction only grows.
    weights = {"probe": 0.5, "dram": 2.0}
    if cuda:
        weights.update(transfer=4.0, pinning=2.0)
    weights["kv"] = 13.0 if cuda else 8.0
    if cuda and plan.split_check_lengths:
        weights["split_check"] = 6.0
    weights["experts"] = 5.0
    prog = Progress(weights, progress, cancel)
    t_start = time.perf_counter()

    prog.step("probe", label="probing the hardware")
    load_before = _load_average()
    machine = probe()
    l3 = machine["cpu"].get("l3_bytes") or FALLBACK_L3
    data: dict = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "fingerprint": fingerprint(machine),
                  "created_utc": _now(), "mode": plan.mode, "machine": machine,
                  "plan": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(plan).items()}}

    prog.step("dram", label="measuring DRAM bandwidth")
    dram_bytes = plan.dram_bytes if _fits(2 * plan.dram_bytes) else max(16 * MiB, plan.dram_bytes // 8)
    data["memory"] = bandwidth.dram_bandwidth(dram_bytes, plan.warmup, plan.repeats)

    data["transfer"], data["pinning"] = {}, {}
    if cuda:
        prog.step("transfer", label="measuring H2D/D2H bandwidth")
        data["transfer"] = bandwidth.transfer_curves(
            list(plan.transfer_sizes), plan.warmup, plan.repeats,
            lambda f: prog.step("transfer", f, "measuring H2D/D2H bandwidth"))
        prog.step("pinning", label="measuring pin cost")
        data["pinning"] = bandwidth.pin_cost(plan.pin_bytes, max(3, plan.repeats // 2))
    else:
        for key in ("h2d", "d2h"):
            mark_unavailable(data["transfer"], key, no_gpu)
        for key in ("register_ms_per_MB", "pin_alloc_ms_per_MB"):
            mark_unavailable(data["pinning"], key, no_gpu)

    data["calibrated_shape"] = shape.key  # the section this run measured (a saved file may hold others)
    data["shapes"] = {shape.key: measure_shape(shape, plan, kernels, cuda, no_gpu, l3, machine, prog)}
    data["duration_s"] = round(time.perf_counter() - t_start, 2)
    # Other programs running during calibration inflate every CPU number: keep the evidence.
    data["load_average"] = {"before": load_before, "after": _load_average(),
                            "usable_cores": machine["cpu"]["usable_cores"]}
    for key in ("before", "after"):
        if data["load_average"][key] is None:
            mark_unavailable(data["load_average"], key, "this system reports no load average")
    prog.done()
    return data


def measure_shape(shape: ModelShape, plan: Plan, kernels: Kernels, cuda: bool, no_gpu: str, l3: int,
                  machine: dict, prog: Progress) -> dict:
    """The per-shape section: KV costs by batch size, then expert costs."""
    entry: dict = {"model": shape.name, "shape": shape.to_dict(), "calibrated_utc": _now(), "mode": plan.mode}
    if shape.expert is None:
        mark_unavailable(entry["shape"], "expert", "a dense model has no routed experts")

    dtype = getattr(torch, shape.kv.dtype)
    cpu_kernel, why = pick(kernels.cpu_attention, shape.kv.n_heads, shape.kv.n_kv_heads, shape.kv.head_dim,
                           dtype, torch.device("cpu"))
    cpu_name = attention_cpu.kernel_name(dtype, shape.kv.n_heads, shape.kv.n_kv_heads, shape.kv.head_dim) \
        if cpu_kernel is ENGINE_CPU else cpu_kernel.name
    kv: dict = {"cpu_kernel": cpu_name, "threads": _threads(cpu_name),
                "bytes_per_token": shape.kv.bytes_per_token, "pingpong_tokens": plan.pingpong_tokens}
    if why:
        kv["cpu_kernel_fallback_reason"] = why
    gpu_kernel = None
    if cuda:
        gpu_kernel, why = pick(kernels.gpu_attention, shape.kv.n_heads, shape.kv.n_kv_heads, shape.kv.head_dim,
                               dtype, torch.device(GPU))
        kv["gpu_kernel"] = gpu_kernel.name
        if why:
            kv["gpu_kernel_fallback_reason"] = why
    else:
        mark_unavailable(kv, "gpu_kernel", no_gpu)

    kv["by_batch"] = {}
    prog.step("kv", label="CPU attention cost A")
    runs = [(b, [kv_costs.OVERHEAD_TOKENS] + [L for L in plan.kv_lengths
                                              if _fits(2 * b * L * shape.kv.bytes_per_token)])
            for b in plan.kv_batches]
    for j, (batch, lengths) in enumerate(runs):
        if len(lengths) < 3:
            continue  # too little memory for a fit at this batch size
        share = 0.5 if cuda else 1.0  # of this batch size's slice of the "kv" step
        label = f"CPU attention cost A (batch {batch})"
        cpu_points = kv_costs.fastest([kv_costs.cpu_attention_points(
            shape.kv, batch, lengths, cpu_kernel, plan.warmup, plan.repeats, l3, gpu_roundtrip=cuda,
            tick=lambda f, j=j, p=p, label=label: prog.step("kv", (j + share * (p + f) / KV_PASSES) / len(runs), label))
            for p in range(KV_PASSES)])
        gpu_points = None
        if cuda:
            label = f"GPU streamed attention cost B (batch {batch})"
            gpu_points = kv_costs.fastest([kv_costs.gpu_attention_points(
                shape.kv, batch, lengths, gpu_kernel, plan.pingpong_tokens, plan.warmup, plan.repeats,
                tick=lambda f, j=j, p=p, label=label: prog.step("kv", (j + 0.5 + 0.5 * (p + f) / KV_PASSES) / len(runs),
                                                                label))
                for p in range(KV_PASSES)])
        costs = kv_costs.kv_costs_for_batch(cpu_points, gpu_points)
        if gpu_points is None:
            for key in ("B_ns_per_token", "C_gpu_ms", "delta_ms", "gpu_points"):
                mark_unavailable(costs, key, no_gpu)
        kv["by_batch"][str(batch)] = costs
    entry["kv"] = kv
    if cuda and plan.split_check_lengths:
        b = plan.split_check_batch
        costs = kv["by_batch"].get(str(b))
        lengths = [L for L in plan.split_check_lengths if _fits(4 * b * L * shape.kv.bytes_per_token)]
        if costs is not None and lengths:
            label = "checking r(L) against a sweep of fixed shares"
            prog.step("split_check", label=label)
            try:  # a check of the costs above, not one of them: its failure must not lose them
                entry["split_check"] = split_check.check(
                    shape.kv, b, lengths, costs, cpu_kernel, gpu_kernel, plan.pingpong_tokens, plan.warmup,
                    plan.repeats, tick=lambda f: prog.step("split_check", f, label))
            except CalibrationCancelled:
                raise
            except Exception as e:
                mark_unavailable(entry, "split_check", f"the check failed: {type(e).__name__}: {e}")

    prog.step("experts", label="expert costs")
    if shape.expert is None:
        entry["experts"] = {}
        mark_unavailable(entry["experts"], "cpu_ms", "a dense model has no routed experts")
        return entry
    gpu_l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size",
                     FALLBACK_L3) if cuda else None
    experts = expert_costs.measure(
        shape.expert, list(plan.expert_tokens), l3, gpu_l2, plan.warmup, plan.repeats, plan.concurrency_ms,
        kernels.cpu_expert.fn, kernels.gpu_expert.fn,
        tick=lambda f: prog.step("experts", f, "expert costs"))
    impl = experts_cpu.implementation(1)  # the engine's kernel: native up to its token limit, torch above
    experts["cpu_kernel"] = kernels.cpu_expert.name if kernels.cpu_expert is not ENGINE_CPU_EXPERT else \
        impl if impl == "torch" else f"{impl} to {experts_cpu.native_max_tokens()} tokens, torch above"
    experts["threads"] = _threads(experts["cpu_kernel"])
    if cuda:
        experts["gpu_kernel"] = kernels.gpu_expert.name
    else:
        for key in ("gpu_kernel", "gpu_ms", "fill_ms", "B_P_GBps", "B_R_GBps", "concurrent"):
            mark_unavailable(experts, key, no_gpu)
    entry["experts"] = experts
    return entry
