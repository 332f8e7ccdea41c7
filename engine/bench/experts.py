"""`tandem bench experts`: expert placement policies side by side on one model and VRAM budget.

For each policy, context length and batch size: prefill of `context` random prompt tokens per
sequence, then `new_tokens` decode steps (EOS ignored), each phase measured on its own (the decode
call reuses the session's KV, so it prefills one token). Per phase: tokens/s, expert cache hit rate,
expert PCIe GB/s, fills, CPU-executed experts, CPU expert time; per run the lookahead predictor's
accuracy. The model loads once; policies switch over the same host store (`switch_expert_policy`),
each with a freshly sized and warmed cache, and first decode every batch size once (graph capture
and kernel compiles stay out of the numbers).

Decode samples (temperature 1, seeded) by default: a random model's greedy decode settles on one
repeated token, so every step would route the same experts — a best case for any cache, not the
near-uniform routing of random routers (the worst case) that the record names. `decode="greedy"`
measures that best case. `shared_prefill` prefills each (context, batch) once, under the first
policy, and decodes every policy from that KV (long contexts: the CPU-only prefill of 32K tokens
alone takes minutes); the other policies then report no prefill.

`trace` records a hot-expert table (tokens per layer and expert) from generations and saves it
where the engine looks for it at load (`tandem bench trace`).
"""

from __future__ import annotations

import statistics
import time

from engine.bench.common import header
from engine.experts.cpu_mailbox import graph_cpu_enabled
from engine.hw.hostmem import huge_page_bytes

# Unmeasured decode steps per policy and batch size before measuring: the step that starts the
# request, the capture's eager warm-up with its kernel compiles, and for `adaptive` the steps until its
# CPU split has measured the worker's first MEASURE_POSTS posts (two to four steps of a 16-layer model).
WARM_TOKENS = 8

POLICIES = ("cpu-only", "on-demand", "static", "adaptive")
ROUTING_NOTE = ("synthetic models route with random routers: expert use is near-uniform, a worst case for any "
                "expert cache; real checkpoints have skewed, temporally local routing")


def _counters(engine) -> dict:
    """Cumulative expert counters and PCIe bytes from the engine's StatsSnapshot."""
    snap = engine.stats()
    return {**snap.experts, "h2d_bytes": snap.pcie["h2d_bytes"]}


def _phase(before: dict, after: dict, seconds: float, tokens: int) -> dict:
    d = {k: (after[k] or 0) - (before[k] or 0) for k in ("hits", "misses", "fills", "cpu_executed", "evictions",
                                                          "prefetch_issued", "prefetch_used", "prefetch_wasted",
                                                          "h2d_bytes", "cpu_expert_s", "cpu_wait_s", "device_wait_s",
                                                          "run_s", "cpu_queue_s")}
    split_before, split_after = before.get("host_split_s") or {}, after.get("host_split_s") or {}
    lookups = d["hits"] + d["misses"]
    return {"tok_s": round(tokens / seconds, 3) if seconds > 0 else None, "tokens": tokens,
            "seconds": round(seconds, 4), "hit_rate": round(d["hits"] / lookups, 4) if lookups else None,
            "pcie_gbps": round(d["h2d_bytes"] / seconds / 1e9, 3) if seconds > 0 else None,
            "cpu_expert_ms_per_token": round(1e3 * d["cpu_expert_s"] / tokens, 3) if tokens else None,
            **{k: d[k] for k in ("fills", "cpu_executed", "evictions", "prefetch_issued", "prefetch_used",
                                 "prefetch_wasted")},
            "cpu_expert_s": round(d["cpu_expert_s"], 4), "cpu_wait_s": round(d["cpu_wait_s"], 4),
            # the GPU-driving thread inside the executor: waiting for the device, for the CPU, the rest host work
            "device_wait_s": round(d["device_wait_s"], 4), "run_s": round(d["run_s"], 4),
            "cpu_queue_s": round(d["cpu_queue_s"], 4),  # the CPU sets' submit → start
            "host_split_s": {k: round(v - split_before.get(k, 0.0), 4) for k, v in split_after.items()}}


def _prefill(engine, prompts: list[list[int]], tag: str):
    """Prefill a batch (and its first token) in sessions kept for the decode → (sessions, firsts, phase)."""
    from engine.api import GenerationRequest

    sessions = [f"{tag}-{i}" for i in range(len(prompts))]
    before = _counters(engine)
    t0 = time.perf_counter()
    first = engine.generate_batch([GenerationRequest(prompt_ids=p, max_new_tokens=1, greedy=True, ignore_eos=True,
                                                     session_id=s) for p, s in zip(prompts, sessions)])
    phase = _phase(before, _counters(engine), time.perf_counter() - t0, sum(r.prefilled_tokens for r in first))
    phase["engine_tok_s"] = first[0].prefill_tok_s  # the engine's own timer (no tokenising, no bookkeeping)
    return sessions, [p + r.token_ids for p, r in zip(prompts, first)], phase


def _decode(engine, sessions: list[str], histories: list[list[int]], new_tokens: int, sample: bool, seed: int):
    """Decode new_tokens per session after its history → (phase, histories grown by the decode)."""
    from engine.api import GenerationRequest

    reqs = [GenerationRequest(prompt_ids=h, max_new_tokens=new_tokens, greedy=not sample, temperature=1.0,
                              seed=seed + i, ignore_eos=True, session_id=s)
            for i, (h, s) in enumerate(zip(histories, sessions))]
    before = _counters(engine)
    t0 = time.perf_counter()
    out = engine.generate_batch(reqs)
    phase = _phase(before, _counters(engine), time.perf_counter() - t0, sum(r.completion_tokens for r in out))
    phase["engine_tok_s"] = out[0].decode_tok_s
    phase["prefilled"] = sum(r.prefilled_tokens for r in out)  # the KV was kept: one token per sequence
    return phase, [h + r.token_ids for h, r in zip(histories, out)]


def _measure(engine, prompts: list[list[int]], new_tokens: int, tag: str, sample: bool = True, seed: int = 0) -> dict:
    """Prefill (first token) and decode (the rest) of a batch, each with its own expert deltas."""
    sessions, histories, prefill = _prefill(engine, prompts, tag)
    decode, _ = _decode(engine, sessions, histories, new_tokens, sample, seed)
    for s in sessions:
        engine.end_session(s)
    return {"prefill": prefill, "decode": decode, "predictor": _counters(engine).get("predictor")}


def _row(engine, policy: str, context: int, bs: int, measured: dict) -> dict:
    tel = engine.backend.parts.experts.telemetry()
    info = engine.info()
    return {"policy": policy, "context": context, "batch": bs, "slots": tel["slots"],
            "cache_gib": round(tel["cache_bytes"] / 2**30, 3), "kv_policy": info["kv_policy"],
            "cuda_graphs": info["cuda_graphs"], "zero_copy": tel.get("zero_copy"), **measured}


def run(model: str = "synthetic:qwen3-30b-a3b", policies=POLICIES, batch_sizes=(1, 4), contexts=(2048,),
        new_tokens: int = 32, vram_budget_gb: float | None = 24.0, device: str = "auto", dtype: str = "auto",
        simulate_hybrid: bool = False, expert_cache_slots: int | None = None, cpu_threads: int | None = None,
        seed: int = 0, warmup: bool = True, engine=None, decode: str = "sample", shared_prefill: bool = False,
        cuda_graphs: bool = True, rounds: int = 1) -> dict:
    """engine: an already loaded engine with an offload policy to measure instead of loading one
    (the caller keeps and closes it; its config decides budget and slots). rounds (with shared_prefill):
    the policies take turns this many times on the shared KV, so a slow spell of the host falls on
    every policy; the ratio reported is the median of the rounds'."""
    import torch

    from engine.api import Engine, EngineConfig

    if decode not in ("sample", "greedy"):
        raise ValueError(f"decode must be 'sample' or 'greedy', got {decode!r}")
    if rounds < 1 or (rounds > 1 and not shared_prefill):
        raise ValueError(f"rounds must be ≥ 1, and more than 1 needs shared_prefill (got {rounds})")
    sample = decode == "sample"
    policies = list(policies)
    t0 = time.perf_counter()
    owned = engine is None
    if owned:
        engine = Engine(EngineConfig(model=model, backend="tandem", device=device, dtype=dtype,
                                     expert_policy=policies[0], vram_budget_gb=vram_budget_gb,
                                     max_batch=max(batch_sizes),
                                     max_context=context_needed(contexts, new_tokens, len(policies) * rounds,
                                                                shared_prefill),
                                     simulate_hybrid=simulate_hybrid, expert_cache_slots=expert_cache_slots,
                                     cpu_threads=cpu_threads, cuda_graphs=cuda_graphs))
    load_s = time.perf_counter() - t0
    config = engine.config
    parts = engine.backend.parts  # read only: model shape, store and cost model for the record
    gen = torch.Generator().manual_seed(seed)
    vocab = parts.args.vocab_size
    prompt = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
    rows = []

    def use(policy: str, warm: bool = True) -> None:
        if engine.info()["expert_policy"] != policy:
            engine.set_expert_policy(policy)
        if warmup and warm:  # first-call costs (kernel compiles, graph capture per batch size) stay out
            for bs in batch_sizes:
                _measure(engine, [prompt(16) for _ in range(bs)], WARM_TOKENS, f"warmup-{bs}", sample, seed)

    try:
        if shared_prefill:
            for context in contexts:
                for bs in batch_sizes:
                    use(policies[0])
                    tag = f"shared-{context}-{bs}"
                    sessions, histories, prefill = _prefill(engine, [prompt(context) for _ in range(bs)], tag)
                    for r in range(rounds):
                        for i, policy in enumerate(policies):
                            # The KV pool holds only the shared sessions: each policy warms up by decoding
                            # WARM_TOKENS on them (graph capture, compiles, the split's first measure), then is measured.
                            use(policy, warm=False)
                            if warmup:
                                _, histories = _decode(engine, sessions, histories, WARM_TOKENS, sample, seed + 1000)
                            dec, histories = _decode(engine, sessions, histories, new_tokens, sample, seed + r)
                            rows.append({**_row(engine, policy, context, bs, {
                                "prefill": prefill if i == 0 and r == 0 else None, "decode": dec,
                                "predictor": _counters(engine).get("predictor")}), "round": r})
                    for s in sessions:
                        engine.end_session(s)
        else:
            for policy in policies:
                use(policy)
                for context in contexts:
                    for bs in batch_sizes:
                        measured = _measure(engine, [prompt(context) for _ in range(bs)], new_tokens,
                                            f"{policy}-{context}-{bs}", sample, seed)
                        rows.append(_row(engine, policy, context, bs, measured))
        store = parts.experts.store
        info = engine.info()
        record = {**header(), "bench": "experts", "model": config.model, "load_s": round(load_s, 1) if owned else None,
                  "vram_budget_gb": config.vram_budget_gb, "device": info["device"], "dtype": info["dtype"],
                  "simulate_hybrid": config.simulate_hybrid, "new_tokens": new_tokens, "decode": decode,
                  "shared_prefill": shared_prefill, "rounds": rounds, "cuda_graphs_config": config.cuda_graphs,
                  "store_gib": round(store.nbytes / 2**30, 3), "store_pinned": store.pinned,
                  "store_huge_pages": store.huge_pages,
                  "store_on_huge_pages_gib": round((huge_page_bytes(store.blocks) or 0) / 2**30, 3),
                  "expert_mib_each": round(store.block_bytes / 2**20, 3), "routed_experts": store.n_routed,
                  "cpu_kernel": parts.experts.cpu_kernel, "gpu_kernel": parts.experts.telemetry()["gpu_kernel"],
                  "cost_model": dict(vars(parts.experts.costs)),
                  # whether the one graph hands misses to the CPU: the environment, which the command line does not show
                  "graph_cpu": graph_cpu_enabled(),
                  "routing": ROUTING_NOTE if config.model.startswith("synthetic:") else None,
                  "results": rows, "adaptive_vs_best_baseline_decode": speedups(rows),
                  "adaptive_vs_best_baseline_decode_per_round": speedups(rows, per_round=True)}
    finally:
        if owned:
            engine.close()
    if torch.cuda.is_available() and not config.simulate_hybrid:
        record["cpu_expert_pinning"] = pinning_penalty()
    return record


def add_arguments(p) -> None:
    """The flags of `tandem bench experts` (the names `from_args` reads)."""
    p.add_argument("--model", default="synthetic:qwen3-30b-a3b")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list")
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--contexts", default="2048")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--vram-budget-gb", type=float, default=24.0)
    p.add_argument("--device", default="auto")
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--expert-cache-slots", type=int, default=None)
    p.add_argument("--simulate-hybrid", action="store_true")
    p.add_argument("--decode", choices=("sample", "greedy"), default="sample",
                   help="sample (temperature 1, seeded): fresh tokens each step; greedy: a random model repeats one token")
    p.add_argument("--shared-prefill", action="store_true",
                   help="prefill each context and batch once, under the first policy, and decode every policy from it")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --shared-prefill: the policies take turns this many times; the ratio is the median")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="decode eagerly (graphs capture decode steps in pieces cut at the offloaded experts)")
    p.add_argument("--json", default=None, help="also write the record here")


def from_args(ns) -> dict:
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    return run(model=ns.model, policies=tuple(ns.policies.split(",")), batch_sizes=ints(ns.batch_sizes),
               contexts=ints(ns.contexts), new_tokens=ns.new_tokens, vram_budget_gb=ns.vram_budget_gb,
               device=ns.device, cpu_threads=ns.cpu_threads, expert_cache_slots=ns.expert_cache_slots,
               simulate_hybrid=ns.simulate_hybrid, decode=ns.decode, shared_prefill=ns.shared_prefill,
               cuda_graphs=ns.cuda_graphs, rounds=ns.rounds)


def context_needed(contexts, new_tokens: int, n_policies: int, shared_prefill: bool) -> int:
    """Tokens a sequence reaches: the prompt, its first token, then the decodes (with shared prefill
    every policy decodes on the same sequence, after a warm-up of WARM_TOKENS each)."""
    decodes = n_policies * (new_tokens + WARM_TOKENS) if shared_prefill else max(new_tokens, WARM_TOKENS)
    return max(contexts) + 1 + decodes + 4


def speedups(rows: list[dict], per_round: bool = False) -> dict:
    """Decode tok/s of adaptive over the better of cpu-only and on-demand of the same round, per
    (context, batch): the median over rounds, or (per_round) the list of the rounds' ratios."""
    ratios: dict[str, list[float]] = {}
    for r in rows:
        if r["policy"] != "adaptive":
            continue
        peers = [q["decode"]["tok_s"] for q in rows if q["policy"] in ("cpu-only", "on-demand")
                 and (q["context"], q["batch"], q.get("round", 0)) == (r["context"], r["batch"], r.get("round", 0))
                 and q["decode"]["tok_s"]]
        if peers and r["decode"]["tok_s"]:
            key = f"ctx{r['context']}-bs{r['batch']}"
            ratios.setdefault(key, []).append(round(r["decode"]["tok_s"] / max(peers), 3))
    if per_round:
        return ratios
    return {key: round(statistics.median(values), 3) for key, values in ratios.items()}


def pinning_penalty(hidden: int = 2048, expert_ffn: int = 768, tokens=(1, 16), repeats: int = 50) -> dict:
    """CPU expert FFN time reading pageable vs page-locked (cudaHostRegister'ed) weights, bf16, in ms.
    Answers whether the store should keep a pageable copy for the CPU (seed 000 §3.1: 10–25 %)."""
    import torch

    from engine.experts.cpu_set import default_cpu_kernel

    ffn, _ = default_cpu_kernel()
    block = torch.randn(3 * hidden * expert_ffn).to(torch.bfloat16)
    split = 2 * expert_ffn * hidden
    gate_up, down = block[:split].view(2 * expert_ffn, hidden), block[split:].view(hidden, expert_ffn)

    def timed(n: int) -> float:
        x = torch.randn(n, hidden).to(torch.bfloat16)
        for _ in range(5):
            ffn(x, gate_up, down)
        t0 = time.perf_counter()
        for _ in range(repeats):
            ffn(x, gate_up, down)
        return 1e3 * (time.perf_counter() - t0) / repeats

    out = {f"pageable_ms_{n}tok": round(timed(n), 4) for n in tokens}
    rt = torch.cuda.cudart()
    torch.cuda.check_error(rt.cudaHostRegister(block.data_ptr(), block.numel() * block.element_size(), 0))
    try:
        out.update({f"pinned_ms_{n}tok": round(timed(n), 4) for n in tokens})
    finally:
        torch.cuda.check_error(rt.cudaHostUnregister(block.data_ptr()))
    return out


def trace(model: str, prompts: list, new_tokens: int = 64, path: str | None = None, **config) -> dict:
    """Load `model` with an offload policy and record its hot-expert table (see record_trace)."""
    import torch

    from engine.api import Engine, EngineConfig

    config.setdefault("expert_policy", "adaptive")
    if not torch.cuda.is_available():
        config.setdefault("simulate_hybrid", True)
    engine = Engine(EngineConfig(model=model, backend="tandem", **config))
    try:
        return record_trace(engine, prompts, new_tokens, path)
    finally:
        engine.close()


def record_trace(engine, prompts: list, new_tokens: int = 64, path: str | None = None) -> dict:
    """Run prompts (chat text, or token-id lists for models without a tokenizer) and save the tokens
    each (layer, expert) received as the model's hot-expert table (default: where loading looks)."""
    from engine.api import GenerationRequest
    from engine.experts.predictor import default_hot_table_path

    ex = engine.backend.parts.experts
    if ex is None or not hasattr(ex, "trace"):
        raise ValueError(f"{engine.config.model} has no offloaded experts to trace")
    ex.trace.counts[:] = 0
    for p in prompts:
        source = {"messages": [{"role": "user", "content": p}]} if isinstance(p, str) else {"prompt_ids": list(p)}
        engine.generate(GenerationRequest(**source, max_new_tokens=new_tokens, greedy=True))
    target = path or str(default_hot_table_path(engine.config.model))
    ex.trace.save(target, engine.config.model)
    return {**header(), "bench": "trace", "model": engine.config.model, "path": target, "prompts": len(prompts),
            "tokens_routed": int(ex.trace.counts.sum()), "top10": ex.trace.top(10)}
