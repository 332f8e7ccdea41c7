"""`tandem bench e2e`: end-to-end decode tokens/s of the whole model for each KV policy.

One engine is loaded (model, expert policy, VRAM budget); for every KV policy the KV backend is
swapped in place (`set_kv_policy`, which also re-sizes the expert cache for the VRAM the new KV
leaves) and for every (batch, context) point:

1. KV fill: each sequence's context is written through the backend's real prefill path (begin_step /
   attend on every layer / end_step, random q, k, v of the model's attention shape), so hybrid
   policies route it to its final regions at write time exactly as a prefill would. Long contexts
   this way cost seconds instead of minutes of MoE prefill; the record says `fill: "kv"`.
2. Decode: `new_tokens` greedy steps of the real model over that KV (EOS ignored), timed by the
   engine's own phase timers; the first step (one prompt token to prefill) is not in the decode rate.

Each point records decode tokens/s (all sequences), ms per step, r and per-region tokens, expert hit
rate and PCIe GB/s in the decode, and the KV bound: KV bytes read per step / (B_H2D + B_CPU), with
B_H2D a pinned copy and B_CPU the host DRAM read rate, both measured in this run (the CPU bound
is what the native attention kernel approaches; its own rate is in `tandem bench cpu-kernels`).
"""

from __future__ import annotations

import sys
import time

import torch

from engine.bench.common import header, write_json
from engine.bench.kv import h2d_gbps
from engine.hw.bandwidth import dram_bandwidth

KV_POLICIES = ("writescope", "gpu-centric", "cpu-centric", "resident")


@torch.inference_mode()
def fill_session(engine, key: str, context: int, gen: torch.Generator) -> list[int]:
    """Write `context` tokens of random KV into a new session through the real prefill path; the
    session then believes it holds those (random) token ids."""
    backend = engine.backend
    parts, generator = backend.parts, backend.generator
    a = parts.args
    session = generator.session(key)
    kv = parts.kv
    # One step for the whole context: a sequence's first step attends to its own k, v, so no layer
    # reads back KV already routed to host memory (a chunked fill would make the CPU attend every
    # later chunk over the host share — minutes at 32K, and not what is being measured).
    kv.begin_step([session.seq_id], context)
    for layer in range(a.n_layers):
        q = torch.randn((1, a.n_heads, context, a.head_dim), device=parts.device, dtype=parts.dtype)
        k = torch.randn((1, a.n_kv_heads, context, a.head_dim), device=parts.device, dtype=parts.dtype)
        kv.attend(layer, q, k, torch.randn_like(k))
    kv.end_step()
    session.cached = torch.randint(0, a.vocab_size, (context,), generator=gen).tolist()
    return session.cached


def _counters(engine) -> dict:
    snap = engine.stats()
    ex = snap.experts or {}
    return {"hits": ex.get("hits") or 0, "misses": ex.get("misses") or 0, "h2d_bytes": snap.pcie["h2d_bytes"] or 0}


def measure_point(engine, bs: int, context: int, new_tokens: int, gen: torch.Generator) -> dict:
    from engine.api import GenerationRequest

    keys = [f"e2e-{bs}-{context}-{i}" for i in range(bs)]
    t0 = time.perf_counter()
    prompts = [fill_session(engine, k, context, gen) for k in keys]
    if engine.backend.parts.device.type == "cuda":
        torch.cuda.synchronize()
    if hasattr(engine.backend.parts.kv, "synchronize"):
        engine.backend.parts.kv.synchronize()
    fill_s = time.perf_counter() - t0
    nxt = torch.randint(0, engine.backend.parts.args.vocab_size, (bs,), generator=gen).tolist()
    before = _counters(engine)
    t0 = time.perf_counter()
    results = engine.generate_batch([GenerationRequest(prompt_ids=p + [t], max_new_tokens=new_tokens, greedy=True,
                                                       ignore_eos=True, session_id=k)
                                     for p, t, k in zip(prompts, nxt, keys)])
    wall = time.perf_counter() - t0
    after = _counters(engine)
    kv_tel = engine.backend.parts.kv.telemetry()
    for k in keys:
        engine.end_session(k)
    r = results[0]
    lookups = (after["hits"] - before["hits"]) + (after["misses"] - before["misses"])
    return {"bs": bs, "context": context, "fill": "kv", "fill_s": round(fill_s, 3),
            "prefilled_tokens": sum(x.prefilled_tokens for x in results),
            "decode_tok_s": r.decode_tok_s, "ms_per_step": round(1e3 * bs / r.decode_tok_s, 3) if r.decode_tok_s else None,
            "ttft_s": r.ttft_s, "wall_s": round(wall, 3),
            "expert_hit_rate": round((after["hits"] - before["hits"]) / lookups, 4) if lookups else None,
            "pcie_gbps": round((after["h2d_bytes"] - before["h2d_bytes"]) / wall / 1e9, 3),
            "r_target": kv_tel.get("r_target"), "r_deployed": kv_tel.get("r_deployed"),
            "kv_tokens": kv_tel.get("tokens")}


def run(model: str = "synthetic:qwen3-30b-a3b", kv_policies=KV_POLICIES, expert_policy: str = "adaptive",
        batch_sizes=(1, 4), contexts=(2048, 8192, 32768), new_tokens: int = 16, vram_budget_gb: float | None = 24.0,
        device: str = "auto", cpu_threads: int | None = None, simulate_hybrid: bool = False, seed: int = 0,
        progress=print, partial_path: str | None = None, cuda_graphs: bool = True) -> dict:
    """partial_path: after every point the record so far is written there with "complete": false,
    so a run cut short by a time limit still leaves what it measured."""
    from engine.api import Engine, EngineConfig

    kv_policies = list(kv_policies)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=model, backend="tandem", device=device, kv_policy=kv_policies[0],
                                 expert_policy=expert_policy, vram_budget_gb=vram_budget_gb,
                                 max_batch=max(batch_sizes), max_context=max(contexts) + new_tokens + 2,
                                 simulate_hybrid=simulate_hybrid, cpu_threads=cpu_threads,
                                 cuda_graphs=cuda_graphs))
    load_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(seed)
    parts = engine.backend.parts
    a = parts.args
    token_bytes = 2 * a.n_kv_heads * a.head_dim * parts.dtype.itemsize * a.n_layers  # KV bytes per token, all layers
    b_h2d = h2d_gbps(parts.device)
    b_cpu = dram_bandwidth(1 << 30, 1, 5)["read_GBps"] if parts.device.type == "cuda" else None
    rows = []
    info = engine.info()

    def meta() -> dict:
        return {**header(), "bench": "e2e", "model": model, "load_s": round(load_s, 1),
                "vram_budget_gb": vram_budget_gb, "device": info["device"], "dtype": info["dtype"],
                "new_tokens": new_tokens, "simulate_hybrid": simulate_hybrid, "cuda_graphs": cuda_graphs, "b_h2d_gbps": b_h2d, "b_cpu_gbps": b_cpu,
                "fill_note": "context written as random KV through each policy's real prefill/routing path (KV fill)"}

    progress(f"[e2e] loaded {model} in {load_s:.1f} s")
    try:
        for policy in kv_policies:
            if engine.info()["kv_policy"] != policy:
                engine.backend.set_kv_policy(policy)
            for bs in batch_sizes:  # warm-up: kernel selection, allocator growth, a decode graph per batch size
                measure_point(engine, bs, min(64, min(contexts)), 3, gen)
            slots = (parts.experts.telemetry().get("slots") if parts.experts is not None else None)
            for context in contexts:
                for bs in batch_sizes:
                    row = {"kv_policy": policy, "expert_policy": engine.info()["expert_policy"], "expert_slots": slots,
                           **measure_point(engine, bs, context, new_tokens, gen)}
                    kv_bytes = bs * context * token_bytes
                    row["kv_bytes_per_step"] = kv_bytes
                    row["kv_bound_ms_per_step"] = (round(kv_bytes / ((b_h2d + b_cpu) * 1e9) * 1e3, 3)
                                                   if b_h2d and b_cpu else None)
                    rows.append(row)
                    progress(f"[e2e] {policy} bs={bs} L={context}: {row['decode_tok_s']} tok/s "
                             f"(fill {row['fill_s']} s, decode wall {row['wall_s']} s)")
                    if partial_path:
                        write_json({**meta(), "complete": False, "results": rows}, partial_path, echo=False)
        record = {**meta(), "complete": True, "results": rows}
    finally:
        engine.close()
    return record


def add_arguments(p) -> None:
    p.add_argument("--model", default="synthetic:qwen3-30b-a3b")
    p.add_argument("--kv-policies", default=",".join(KV_POLICIES))
    p.add_argument("--expert-policy", default="adaptive")
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--contexts", default="2048,8192,32768")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--vram-budget-gb", type=float, default=24.0)
    p.add_argument("--device", default="auto")
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--simulate-hybrid", action="store_true")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run every decode step eagerly (the comparison for the graphs' gain)")
    p.add_argument("--json", default=None, help="also write the record here")


def from_args(ns) -> dict:
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    return run(model=ns.model, kv_policies=tuple(ns.kv_policies.split(",")), expert_policy=ns.expert_policy,
               batch_sizes=ints(ns.batch_sizes), contexts=ints(ns.contexts), new_tokens=ns.new_tokens,
               vram_budget_gb=ns.vram_budget_gb or None, device=ns.device, cpu_threads=ns.cpu_threads,
               simulate_hybrid=ns.simulate_hybrid, partial_path=ns.json, cuda_graphs=ns.cuda_graphs,
               progress=lambda m: print(m, file=sys.stderr, flush=True))
