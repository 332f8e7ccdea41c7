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
The fill and the KV bytes per token follow the model's KV: per-head K and V, or one latent row per
token and layer (MLA), over the layers that store KV only (engine/bench/e2e_fill.py).

Points that do not fit are rows, not the end of the run. Before a point its KV is compared with the
host memory available (e2e_fill.host_shortfall): one that would swap is refused with its reason. A
point that runs out of memory anyway (torch's or the engine's OutOfMemoryError, a failed host or
pinned allocation) or whose policy cannot be built (ConfigError) is recorded with its error; the
policy's KV is rebuilt and the run goes on with the next point. So is a batch whose decode step
failed and that the generator then ran one sequence at a time: its rate would not be the batch's.
`largest` in the record is, per policy, the largest aggregate context (chats × tokens) that ran.

`--aggregate-chats N` then looks past the grid: the model is loaded again with max_batch N (the grid
keeps max_batch at its largest batch size, so its D-windows, monolithic buffers and expert cache are
those of the grid's own points) and, per policy, the chats at the largest context double from twice
the largest batch size up to N, stopping at the first point that is refused or fails.
"""

from __future__ import annotations

import gc
import logging
import sys
import time

import psutil
import torch

from engine.bench.common import header, write_json
from engine.bench.e2e_fill import fill_session, host_shortfall, kv_token_bytes
from engine.bench.kv import h2d_gbps
from engine.errors import ConfigError, OutOfMemoryError
from engine.hw.bandwidth import dram_bandwidth

KV_POLICIES = ("writescope", "gpu-centric", "cpu-centric", "monolithic", "resident")
# what a failed allocation says where it is not a typed OutOfMemoryError (a pinned host buffer: the
# CUDA runtime's error; a pageable one: the CPU allocator's)
_OOM_WORDS = ("out of memory", "can't allocate memory", "not enough memory")


def does_not_fit(e: BaseException) -> bool:
    """An exception that means the point or policy does not fit this machine (recorded, the run goes on);
    any other is a fault and ends the run."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError, OutOfMemoryError, ConfigError)):
        return True
    return isinstance(e, RuntimeError) and any(w in str(e).lower() for w in _OOM_WORDS)


def _error(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else "no message"
    return f"{type(e).__name__}: {text}"


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
    with _SplitSteps() as split:
        results = engine.generate_batch([GenerationRequest(prompt_ids=p + [t], max_new_tokens=new_tokens, greedy=True,
                                                           ignore_eos=True, session_id=k)
                                         for p, t, k in zip(prompts, nxt, keys)])
    wall = time.perf_counter() - t0
    if split.failures:  # the rate is of single-sequence steps, not of this batch: the point did not run
        for k in keys:
            engine.end_session(k)
        raise split.failures[0]
    failed = next((r for r in results if r.finish_reason not in ("length", "stop")), None)
    if failed is not None:
        for k in keys:
            engine.end_session(k)
        raise RuntimeError(f"a sequence's decode ended '{failed.finish_reason}' after "
                           f"{failed.completion_tokens} of {new_tokens} tokens")
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
            "A_ns_per_token": kv_tel.get("A_ns_per_token"), "B_ns_per_token": kv_tel.get("B_ns_per_token"),
            "costs_from": kv_tel.get("costs_from"), "costs_start": kv_tel.get("costs_start"), "kv_tokens": kv_tel.get("tokens")}


class _SplitSteps(logging.Handler):
    """Catches the generator's report that a batched decode step failed and was retried one sequence at
    a time (runtime/generator.py): the step's exception as a RuntimeError naming it, so that a batch
    that ran out of memory is a row with its error instead of a rate of single-sequence steps."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.failures: list[RuntimeError] = []

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("a decode step of"):
            self.failures.append(RuntimeError(record.getMessage()))

    def __enter__(self):
        logging.getLogger("tandem").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("tandem").removeHandler(self)


class _Bench:
    """One loaded engine and what every point's row needs: the KV bytes per token, the bounds' rates."""

    def __init__(self, model: str, config: dict, policies: list[str], new_tokens: int, seed: int, progress):
        """Loaded with the first of `policies` that can be built (the others are switched to in place)."""
        from engine.api import Engine, EngineConfig

        self.broken: dict[str, str] = {}  # policy → why it cannot be built
        t0 = time.perf_counter()
        for i, policy in enumerate(policies):
            try:
                self.engine = Engine(EngineConfig(model=model, backend="tandem", **config, kv_policy=policy))
                break
            except Exception as e:
                if not does_not_fit(e) or i == len(policies) - 1:
                    raise
                self.broken[policy] = f"the policy cannot be built: {_error(e)}"
                progress(f"[e2e] {policy}: {self.broken[policy]}")
        self.load_s = time.perf_counter() - t0
        self.new_tokens, self.progress = new_tokens, progress
        self.gen = torch.Generator().manual_seed(seed)
        parts = self.engine.backend.parts
        self.token_bytes = kv_token_bytes(parts.args, parts.dtype, model)  # KV bytes per token, KV layers
        self.b_h2d = h2d_gbps(parts.device)
        self.b_cpu = dram_bandwidth(1 << 30, 1, 5)["read_GBps"] if parts.device.type == "cuda" else None
        progress(f"[e2e] loaded {model} in {self.load_s:.1f} s")

    def use(self, policy: str) -> bool:
        """Switch the KV backend to `policy`; False (and the reason kept) when it cannot be built."""
        if policy in self.broken:
            return False
        try:
            if self.engine.info()["kv_policy"] != policy or self.engine.backend.parts.kv is None:
                self.engine.backend.set_kv_policy(policy)
            return True
        except Exception as e:  # only what does_not_fit names is kept; the rest re-raised
            if not does_not_fit(e):
                raise
            self.broken[policy] = f"the policy cannot be built: {_error(e)}"
        self.progress(f"[e2e] {policy}: {self.broken[policy]}")
        self._release()  # outside the handler: the traceback's frames no longer hold the failed buffers
        return False

    def warm(self, policy: str, bs: int, context: int) -> None:
        """Kernel selection, allocator growth, a decode graph for this batch size; a failure is left
        to the measured point to record."""
        if self.use(policy) and not host_shortfall(policy, self.engine.backend.parts.device, bs, context,
                                                   self.token_bytes):
            try:
                measure_point(self.engine, bs, context, 3, self.gen)
                return
            except Exception as e:
                if not does_not_fit(e):
                    raise
            self._recover(policy)

    def point(self, policy: str, bs: int, context: int, phase: str) -> dict:
        """One row: the measurement, or why the point did not run."""
        engine = self.engine
        row = {"kv_policy": policy, "phase": phase, "bs": bs, "context": context, "aggregate_tokens": bs * context,
               "host_available_gib": round(psutil.virtual_memory().available / 2**30, 1)}
        if not self.use(policy):
            return {**row, "error": self.broken[policy]}
        parts = engine.backend.parts
        refused = host_shortfall(policy, parts.device, bs, context, self.token_bytes)
        if refused:
            return {**row, "error": refused, "refused": True}
        slots = parts.experts.telemetry().get("slots") if parts.experts is not None else None
        row.update(expert_policy=engine.info()["expert_policy"], expert_slots=slots)
        error = None
        try:
            row.update(measure_point(engine, bs, context, self.new_tokens, self.gen))
        except Exception as e:
            if not does_not_fit(e):
                raise
            error = _error(e)
        if error:  # rebuilt outside the handler: the traceback's frames no longer hold the point's tensors
            self._recover(policy)
            return {**row, "error": error}
        kv_bytes = bs * context * self.token_bytes
        row["kv_bytes_per_step"] = kv_bytes
        row["kv_bound_ms_per_step"] = (round(kv_bytes / ((self.b_h2d + self.b_cpu) * 1e9) * 1e3, 3)
                                       if self.b_h2d and self.b_cpu else None)
        return row

    def _recover(self, policy: str) -> None:
        """After a point ran out of memory part-way: a fresh backend of the same policy (the failed
        one may hold a step begun and sessions half-filled); set_kv_policy ends every session."""
        self._release()
        try:
            self.engine.backend.set_kv_policy(policy)
            return
        except Exception as e:
            if not does_not_fit(e):
                raise
            self.broken[policy] = f"the policy cannot be rebuilt after running out of memory: {_error(e)}"
        self._release()

    def _release(self) -> None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        self.engine.close()


def _report(progress, row: dict) -> None:
    where = f"[e2e] {row['kv_policy']} bs={row['bs']} L={row['context']}"
    if "error" in row:
        progress(f"{where}: not run ({row['error']})")
    else:
        progress(f"{where}: {row['decode_tok_s']} tok/s (fill {row['fill_s']} s, decode wall {row['wall_s']} s)")


def largest(rows: list[dict]) -> dict:
    """Per policy, the point of the largest aggregate context (chats × tokens) that ran."""
    best: dict[str, dict] = {}
    for r in rows:
        if "error" not in r and r["aggregate_tokens"] > best.get(r["kv_policy"], {}).get("aggregate_tokens", 0):
            best[r["kv_policy"]] = {k: r[k] for k in ("bs", "context", "aggregate_tokens", "decode_tok_s")}
    return best


def run(model: str = "synthetic:qwen3-30b-a3b", kv_policies=KV_POLICIES, expert_policy: str = "adaptive",
        batch_sizes=(1, 4), contexts=(2048, 8192, 32768), new_tokens: int = 16, vram_budget_gb: float | None = 24.0,
        device: str = "auto", cpu_threads: int | None = None, simulate_hybrid: bool = False, seed: int = 0,
        progress=print, partial_path: str | None = None, cuda_graphs: bool = True,
        aggregate_chats: int = 0) -> dict:
    """partial_path: after every point the record so far is written there with "complete": false,
    so a run cut short by a time limit still leaves what it measured. aggregate_chats: see the
    module docstring (0: the grid only)."""
    from engine.runtime.loading import check_policies

    kv_policies = list(kv_policies)
    for policy in kv_policies:  # a misspelt name is the caller's error, not a point that does not fit
        check_policies(policy, expert_policy)
    config = {"device": device, "expert_policy": expert_policy, "vram_budget_gb": vram_budget_gb,
              "max_batch": max(batch_sizes), "max_context": max(contexts) + new_tokens + 2,
              "simulate_hybrid": simulate_hybrid, "cpu_threads": cpu_threads, "cuda_graphs": cuda_graphs}
    rows: list[dict] = []
    bench = _Bench(model, config, kv_policies, new_tokens, seed, progress)
    info = bench.engine.info()
    loads = [round(bench.load_s, 1)]

    def meta() -> dict:
        return {**header(), "bench": "e2e", "model": model, "load_s": loads[0], "aggregate_load_s": loads[1:] or None,
                "vram_budget_gb": vram_budget_gb, "device": info["device"], "dtype": info["dtype"],
                "new_tokens": new_tokens, "simulate_hybrid": simulate_hybrid, "cuda_graphs": cuda_graphs,
                "b_h2d_gbps": bench.b_h2d, "b_cpu_gbps": bench.b_cpu, "kv_bytes_per_token": bench.token_bytes,
                "fill_note": "context written as random KV through each policy's real prefill/routing path (KV fill)",
                "largest": largest(rows)}

    def keep(row: dict) -> None:
        rows.append(row)
        _report(progress, row)
        if partial_path:
            write_json({**meta(), "complete": False, "results": rows}, partial_path, echo=False)

    try:
        for policy in kv_policies:
            for bs in batch_sizes:
                bench.warm(policy, bs, min(64, min(contexts)))
            for context in contexts:
                for bs in batch_sizes:
                    keep(bench.point(policy, bs, context, "grid"))
        if aggregate_chats > max(batch_sizes):
            bench.close()
            bench = _Bench(model, {**config, "max_batch": aggregate_chats}, kv_policies, new_tokens, seed + 1, progress)
            loads.append(round(bench.load_s, 1))
            context = max(contexts)
            for policy in kv_policies:
                chats = 2 * max(batch_sizes)
                while chats <= aggregate_chats:
                    bench.warm(policy, chats, min(64, min(contexts)))
                    row = bench.point(policy, chats, context, "aggregate")
                    keep(row)
                    if "error" in row:
                        break
                    chats *= 2
        record = {**meta(), "complete": True, "results": rows}
    finally:
        bench.close()
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
    p.add_argument("--aggregate-chats", type=int, default=0,
                   help="after the grid, double the chats at the largest context up to this many (a second "
                        "load with this max_batch), stopping at the first point that does not fit")
    p.add_argument("--json", default=None, help="also write the record here")


def from_args(ns) -> dict:
    ints = lambda text: tuple(int(x) for x in text.split(","))
    return run(model=ns.model, kv_policies=tuple(ns.kv_policies.split(",")), expert_policy=ns.expert_policy,
               batch_sizes=ints(ns.batch_sizes), contexts=ints(ns.contexts), new_tokens=ns.new_tokens,
               vram_budget_gb=ns.vram_budget_gb or None, device=ns.device, cpu_threads=ns.cpu_threads,
               simulate_hybrid=ns.simulate_hybrid, partial_path=ns.json, cuda_graphs=ns.cuda_graphs,
               aggregate_chats=ns.aggregate_chats,
               progress=lambda m: print(m, file=sys.stderr, flush=True))
