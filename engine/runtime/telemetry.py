"""Counters the engine keeps as it runs, and the StatsSnapshot built from them on request.

The engine only counts; readers (the app's panels, `--stats-json`, exports) call
`Engine.stats()` whenever they like. A value that does not apply is None (JSON null), never 0.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import psutil
import torch


@dataclass
class StatsSnapshot:
    phase: str  # "idle" | "prefill" | "decode"
    vram: dict  # bytes: weights, expert_cache, kv_dwindow, kv_pingpong, kv_resident, workspace, budget, device_total, device_used
    host: dict  # bytes: kv_pinned, kv_unpinned, expert_store, rss
    kv: dict  # policy, tokens {dwindow, pinned, unpinned, resident}, r_target, r_deployed, A_ns_per_token, B_ns_per_token, delta_ms, costs_from (where A, B, Δ started)
    experts: dict  # policy, hits, misses, fills, cpu_executed, evictions, prefetch_used, prefetch_wasted, hit_rate
    pcie: dict  # h2d_bytes, d2h_bytes, h2d_gbps, d2h_gbps
    speed: dict  # prefill_tok_s, decode_tok_s, ttft_s (of the last generation); prefill_done/_total (now)
    kernels: dict  # implementation behind cpu_attention and cpu_experts (None: not run on the CPU)
    profile: str | None  # calibration profile in use
    model: dict = field(default_factory=dict)  # name, family, layers, experts, device, dtype

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)


@dataclass
class GenerationTimer:
    """Wall-clock split of one generate call into prefill and decode."""

    t_start: float = field(default_factory=time.perf_counter)
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    ttft_s: float | None = None

    @property
    def prefill_tok_s(self) -> float | None:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 and self.prefill_tokens else None

    @property
    def decode_tok_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 and self.decode_tokens else None


class Telemetry:
    def __init__(self):
        self.phase = "idle"
        self.last: GenerationTimer | None = None
        # the prompt being read now: its tokens in the KV (reused or computed) and in all; None between prefills
        self.prefill_read: tuple[int, int] | None = None

    def snapshot(self, *, device: torch.device, weights_bytes: int, kv_tel: dict, experts_tel: dict | None,
                 vram_budget_bytes: int | None, model_info: dict, profile: str | None) -> StatsSnapshot:
        on_gpu = device.type == "cuda"
        kv_bytes = kv_tel.get("bytes", {})
        vram = dict.fromkeys(("weights", "expert_cache", "kv_dwindow", "kv_pingpong", "kv_resident",
                              "workspace", "budget", "device_total", "device_used"))
        if on_gpu:
            free, total = torch.cuda.mem_get_info(device)
            allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
            vram.update(weights=weights_bytes, workspace=reserved - allocated, budget=vram_budget_bytes,
                        device_total=total, device_used=total - free)
            for region in ("kv_dwindow", "kv_pingpong", "kv_resident"):
                vram[region] = kv_bytes.get(region)
            if experts_tel is not None:
                vram["expert_cache"] = experts_tel.get("cache_bytes")
        pinned = kv_bytes.get("kv_pinned")  # every page-locked byte the KV holds: load region and staging
        if pinned is not None and kv_bytes.get("kv_staging"):
            pinned += kv_bytes["kv_staging"]
        host = {"kv_pinned": pinned, "kv_unpinned": kv_bytes.get("kv_unpinned"),
                "expert_store": (experts_tel or {}).get("store_bytes"), "rss": psutil.Process().memory_info().rss,
                "expert_store_types": (experts_tel or {}).get("store_types")}  # a GGUF's blocks kept: their types
        kv_tokens = {"dwindow": None, "pinned": None, "unpinned": None, "resident": None}
        kv_tokens.update(kv_tel.get("tokens", {}))
        kv = {"policy": kv_tel.get("policy"), "tokens": kv_tokens}
        for key in ("r_target", "r_deployed", "A_ns_per_token", "B_ns_per_token", "delta_ms", "costs_from"):
            kv[key] = kv_tel.get(key)
        experts = dict.fromkeys(("policy", "hits", "misses", "fills", "cpu_executed", "evictions",
                                 "prefetch_used", "prefetch_wasted", "hit_rate",
                                 "prefetch_issued", "slots", "cpu_expert_s", "cpu_wait_s", "device_wait_s",
                                 "run_s", "cpu_queue_s", "host_split_s", "cpu_correction", "step_ratio",
                                 "predictor", "zero_copy"))
        experts.update({k: v for k, v in (experts_tel or {}).items() if k in experts})
        pcie = dict.fromkeys(("h2d_bytes", "d2h_bytes", "h2d_gbps", "d2h_gbps"))
        pcie.update(kv_tel.get("pcie", {}))
        for key in ("h2d_bytes", "h2d_gbps"):  # expert fills and prefetches add to the KV's own traffic
            extra = (experts_tel or {}).get(key)
            if extra is not None:
                pcie[key] = (pcie[key] or 0) + extra
        t = self.last
        read = self.prefill_read
        speed = {"prefill_tok_s": t and t.prefill_tok_s, "decode_tok_s": t and t.decode_tok_s,
                 "ttft_s": t and t.ttft_s, "prefill_done": read and read[0], "prefill_total": read and read[1]}
        kernels = {"cpu_attention": kv_tel.get("cpu_kernel") or ("torch-sdpa" if device.type == "cpu" else None),
                   "cpu_experts": (experts_tel or {}).get("cpu_kernel")}
        return StatsSnapshot(phase=self.phase, vram=vram, host=host, kv=kv, experts=experts, pcie=pcie,
                             speed=speed, kernels=kernels, profile=profile, model=model_info)
