"""`tandem bench soak`: a long decode on the hybrid path with a tiny D-window and expert cache (a flush
every few tokens, an eviction and a fill on nearly every layer), checked against resident execution
in windows, with the process's resources sampled so that leaks show as growth.

Each window is one sequence: a short real-text prompt, then `window` greedy decode steps on the
hybrid engine (WriteScope KV, adaptive experts; simulated on the CPU when there is no GPU). The
resident engine then reads the prompt plus the hybrid's tokens in one teacher-forced pass; every
hybrid token must be the resident argmax at its position, or within NEAR_TIE of it (fp32 sums in
another order move logits by ~1e-5). The window's sequence is then freed, so a window's regions,
slots and buffers are reused by the next: after the first window (warm-up: pools grow to their
working size) RSS, pinned bytes, GPU bytes and open file descriptors must stay within the stated
bounds.
"""

from __future__ import annotations

import gc
import time
from typing import Callable

import psutil
import torch

from engine.api import Engine, EngineConfig
from engine.bench.common import header

NEAR_TIE = 1e-3  # logits
RSS_BOUND_BYTES = 64 * 2**20  # growth after warm-up: allocator slack, Python caches; a leak of one
# window's KV or expert buffers per window would exceed it within a few windows
PROMPTS = ["The lighthouse keeper climbed the stairs and", "In the old harbour town, the fishermen",
           "A short history of the printing press:", "The recipe for bread begins with",
           "When the storm reached the coast,", "Dear diary, today I learned that",
           "The mathematician wrote on the blackboard", "Under the northern lights, the travellers"]


def resources(kv_tel: dict, expert_tel: dict | None) -> dict:
    proc = psutil.Process()
    pinned = (kv_tel.get("bytes", {}).get("kv_pinned") or 0)
    return {"rss": proc.memory_info().rss, "fds": proc.num_fds() if hasattr(proc, "num_fds") else None,
            "pinned": pinned, "gpu": torch.cuda.memory_allocated() if torch.cuda.is_available() else None,
            "expert_store_pinned": bool(expert_tel and expert_tel.get("store_pinned"))}


@torch.inference_mode()
def reference_argmax_check(ref: Engine, prompt: list[int], generated: list[int]) -> dict:
    """Teacher-forced resident logits over prompt + generated[:-1]; how each hybrid token compares."""
    p, kv = ref.parts, ref.parts.kv
    ids = prompt + generated[:-1]
    sid = kv.new_sequence()
    try:
        positions = kv.begin_step([sid], len(ids))
        logits = p.model(torch.tensor([ids], device=p.device), positions, kv, last_only=False)[0]  # (T, V)
        kv.end_step()
    finally:
        kv.free(sid)
    rows = logits[len(prompt) - 1:].float().cpu()  # (W, V): the logits each generated token came from
    best = rows.max(-1).values
    chosen = rows.gather(1, torch.tensor(generated)[:, None])[:, 0]
    gap = (best - chosen)  # 0 where the hybrid picked the resident argmax
    return {"mismatches": int((gap > 0).sum()), "worst_gap": float(gap.max()), "ok": bool((gap <= NEAR_TIE).all())}


def run(steps: int = 10_000, window: int = 500, d_window: int = 16, block_size: int = 16,
        expert_cache_slots: int = 48, model: str = "builtin:smollm2-135m-moe", device: str = "auto",
        progress: Callable[[str], None] | None = None) -> dict:
    say = progress or (lambda s: None)
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    common = dict(model=model, backend="tandem", device="cuda" if cuda else "cpu", dtype="float32", max_batch=1,
                  max_context=window + 64)
    say("loading the hybrid engine")
    hybrid = Engine(EngineConfig(**common, kv_policy="writescope", expert_policy="adaptive", d_window=d_window,
                                 block_size=block_size, expert_cache_slots=expert_cache_slots,
                                 simulate_hybrid=not cuda))
    say("loading the resident reference")
    ref = Engine(EngineConfig(**common))
    windows, samples, t0 = [], [], time.perf_counter()
    done, w = 0, 0
    try:
        while done < steps:
            n = min(window, steps - done)
            prompt = hybrid.tokenize(PROMPTS[w % len(PROMPTS)] + f" (part {w + 1})")
            ts = time.perf_counter()
            generated = hybrid.generate_ids(prompt, n, greedy=True, ignore_eos=True)
            decode_s = time.perf_counter() - ts
            check = reference_argmax_check(ref, prompt, generated)
            gc.collect()
            stats = hybrid.stats().to_dict()
            sample = resources(hybrid.parts.kv.telemetry(), hybrid.parts.experts.telemetry())
            sample["step"] = done + n
            samples.append(sample)
            windows.append({"window": w, "steps": n, "decode_tok_s": n / decode_s, **check,
                            "experts": {k: stats["experts"][k] for k in ("hits", "fills", "evictions", "cpu_executed")},
                            "pcie_d2h_bytes": stats["pcie"]["d2h_bytes"]})
            done += n
            w += 1
            say(f"{done}/{steps} steps, window {w}: {windows[-1]['mismatches']} near-tie mismatches, "
                f"rss {sample['rss'] / 2**20:.0f} MiB, fds {sample['fds']}")
    finally:
        hybrid.close()
        ref.close()
    return {**header(), "bench": "soak", "model": model, "steps": steps, "window": window, "d_window": d_window,
            "block_size": block_size, "expert_cache_slots": expert_cache_slots, "device": common["device"],
            "simulated_hybrid": not cuda, "wall_s": time.perf_counter() - t0, "near_tie": NEAR_TIE,
            "windows": windows, "samples": samples, "growth": growth(samples)}


def growth(samples: list[dict]) -> dict:
    """Growth of each resource from the end of the first window (warm-up) to the largest later sample,
    against its bound: RSS within RSS_BOUND_BYTES; pinned bytes, GPU bytes and descriptors not at all."""
    if len(samples) < 2:
        return {"checked": False}
    base, later = samples[0], samples[1:]
    out = {"checked": True}
    for key, bound in (("rss", RSS_BOUND_BYTES), ("pinned", 0), ("gpu", 0), ("fds", 0)):
        if base[key] is None:
            out[key] = None
            continue
        grew = max(s[key] for s in later) - base[key]
        out[key] = {"growth": grew, "bound": bound, "ok": grew <= bound}
    out["ok"] = all(v["ok"] for k, v in out.items() if isinstance(v, dict))
    return out
