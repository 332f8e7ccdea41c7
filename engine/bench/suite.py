"""`tandem bench suite`: the canonical cells, each with its peer or bound measured in the same run.

    tandem bench suite --quick --json benchmarks/suite/cpu-quick.json    # the CPU cells
    tandem bench suite --json out.json                                   # every cell this machine can run
    tandem bench suite --cells cpu-builtin --against HEAD~3 --rounds 5   # A/B against another commit

A cell is one question ("how fast does Tandem decode the built-in model, against llama.cpp on the
same file?") answered by one command (`tandem bench suite --cells ID`). Every cell measures Tandem
and its peer (another engine on the same weights) or its bound (what the hardware allows, measured
in the same run) in several rounds, taking turns, the order reversed every other round, so a slow
spell of a shared machine falls on both sides; each figure is the median of the rounds, with the
spread (min–max), and the ratio Tandem / peer is the median of the per-round ratios.

Every Tandem measurement runs in a fresh process (`suite_probe.py`, or a `tandem bench` command of
the tree) with PYTHONPATH set to the source tree under test. `--against COMMIT` adds a git worktree
of that commit as a second tree; its rounds alternate with this tree's, and each row gains the A/B
ratio (this tree / that one). That is the one way A/B runs are made: no source is edited for a run.
Cells whose hardware is absent are skipped with the reason. The record is one JSON object; the
markdown table (`suite_table.py`) is written beside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.bench.common import header
from engine.bench.suite_cell import Cell, Ctx, Skip, Tree, alternate, probe, row, tandem_cli

REPO = Path(__file__).resolve().parents[2]


# ---- the CPU cells ------------------------------------------------------------------------------

def cell_cpu_builtin(ctx: Ctx, model: str = "builtin:smollm2-135m") -> list[dict]:
    """Built-in SmolLM2-135M: Tandem's default plan against llama.cpp (llama-cpp-python) on the same GGUF.
    model: what Tandem runs of it (the upcycled MoE: the app's default; llama.cpp runs the file as it is)."""
    threads = ctx.threads or os.cpu_count() or 1
    # --quick: short enough that three rounds of both engines fit in minutes on a busy 2-core machine
    spec = {"prefill": 64 if ctx.quick else 512, "decode_prompt": 32, "new_tokens": 24 if ctx.quick else 128,
            "seed": 0, "warmup": True, "warmup_tokens": 4 if ctx.quick else 8}
    tandem = {"model": model, "backend": "tandem", "device": "cpu", "cpu_threads": threads}
    # llama.cpp has no hybrid policies: its backend takes the resident ones explicitly
    llama = {"model": "builtin:smollm2-135m", "backend": "llamacpp", "cpu_threads": threads, "max_context": 2048,
             "kv_policy": "resident", "expert_policy": "resident"}
    systems = {name: (lambda t=ctx.tree_of(name): probe(t.path, {**spec, "config": tandem}))
               for name in ctx.tandem_names()}
    systems["llama.cpp"] = lambda: probe(ctx.trees[0].path, {**spec, "config": llama})
    res = alternate(ctx, systems)
    info = {name: rs[-1].get("info") for name, rs in res.items()}
    plans = {name: rs[-1].get("plan") for name, rs in res.items() if rs[-1].get("plan")}
    cond = f"{threads} threads, greedy, EOS ignored"
    decode_cond = f"{spec['new_tokens']} tokens after a {spec['decode_prompt']}-token prompt, {cond}"
    return [row(ctx, "decode tok/s", decode_cond,
                {n: [r["decode_tok_s"] for r in rs] for n, rs in res.items()}, "llama.cpp", info=info, plan=plans),
            row(ctx, "prefill tok/s", f"{spec['prefill']}-token prompt, {cond}",
                {n: [r["prefill_tok_s"] for r in rs] for n, rs in res.items()}, "llama.cpp",
                target="prefill ≥ 50% of llama.cpp")]


SPIN = "import os; os.sched_setaffinity(0, {0}); exec('while True: pass')"  # another program, on core 0


def cell_cpu_busy_core(ctx: Ctx) -> list[dict]:
    """Decode while another process keeps core 0 busy: Tandem with its default threads (its decode
    steps measure the count: engine/runtime/thread_chooser.py) against llama.cpp on every core, as its
    own programs run, and llama.cpp inside Tandem (what `backend auto` runs for a GGUF on a CPU-only
    machine; its decode threads measured the same way). Each probe is a fresh process (engines in one
    process slowed each other in a first measurement), so the figures include finding the core."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        raise Skip("needs Linux and two usable cores")
    cores = len(os.sched_getaffinity(0))
    spec = {"decode_prompt": 32, "new_tokens": 48 if ctx.quick else 128, "seed": 0, "warmup": True, "warmup_tokens": 8}
    tandem = {"model": "builtin:smollm2-135m", "backend": "tandem", "device": "cpu"}
    llama = {"model": "builtin:smollm2-135m", "backend": "llamacpp", "cpu_threads": cores, "max_context": 2048,
             "kv_policy": "resident", "expert_policy": "resident"}

    def beside_a_busy_core(measure):
        def run():
            spinner = subprocess.Popen([sys.executable, "-c", SPIN])
            try:
                return measure()
            finally:
                spinner.kill()
                spinner.wait()
        return run

    systems = {name: beside_a_busy_core(lambda t=ctx.tree_of(name): probe(t.path, {**spec, "config": tandem}))
               for name in ctx.tandem_names()}
    systems["llama.cpp"] = beside_a_busy_core(lambda: probe(ctx.trees[0].path, {**spec, "config": llama}))
    inside = {k: v for k, v in llama.items() if k != "cpu_threads"}
    systems["llama.cpp in Tandem"] = beside_a_busy_core(lambda: probe(ctx.trees[0].path, {**spec, "config": inside}))
    res = alternate(ctx, systems)
    cond = (f"{spec['new_tokens']} tokens after a {spec['decode_prompt']}-token prompt, core 0 kept busy by another "
            f"process; Tandem's default threads, llama.cpp on all {cores} cores")
    return [row(ctx, "decode tok/s", cond, {n: [r["decode_tok_s"] for r in rs] for n, rs in res.items()}, "llama.cpp",
                info={name: rs[-1].get("info") for name, rs in res.items()})]


def cell_cpu_kernels(ctx: Ctx) -> list[dict]:
    """The native CPU kernels against the STREAM read of the same call (the bound)."""
    threads = ctx.threads or os.cpu_count() or 1
    args = ["bench", "cpu-kernels", "--sections", "stream,attention,experts", "--thread-counts", str(threads),
            "--lengths", "32k", "--batches", "1", "--tokens", "1,4", "--no-torch-sdpa", "--repeats", "5"]
    # not `--quick` even in the quick suite: its smaller buffers let rotated experts sit in L3, and
    # then the STREAM read is no bound for them
    systems = {name: (lambda t=ctx.tree_of(name): tandem_cli(t.path, args)) for name in ctx.tandem_names()}
    res = alternate(ctx, systems)

    def stream(rec):
        return next(s["read_GBps"] for s in rec["stream"] if s["threads"] == threads)

    def attention(rec):
        return next(a["native_GBps"] for a in rec["attention"] if a["threads"] == threads and a["batch"] == 1)

    def expert(rec, n):
        return next(p["native_GBps"] for p in rec["experts"]["points"] if p["threads"] == threads and p["tokens"] == n)

    rows = []
    for metric, cond, get, target in (
            ("decode attention, GB/s of KV", f"one Qwen3-30B-A3B layer, bf16 KV, 32K tokens, bs=1, {threads} threads",
             attention, "≥ 80% of the STREAM read"),
            ("expert FFN, GB/s of weights", f"2048×768 bf16 SwiGLU expert, 1 token, {threads} threads",
             lambda r: expert(r, 1), "≥ 70 GB/s on the H200 host"),
            ("expert FFN, GB/s of weights", f"2048×768 bf16 SwiGLU expert, 4 tokens, {threads} threads",
             lambda r: expert(r, 4), "≥ 70 GB/s on the H200 host")):
        samples = {n: [get(r) for r in rs] for n, rs in res.items()}
        # the bound of each Tandem run is the STREAM read of that same call
        bound = {f"STREAM read ({n})" if len(ctx.trees) > 1 else "STREAM read": [stream(r) for r in rs]
                 for n, rs in res.items()}
        peer = next(iter(bound))
        samples.update(bound)
        rows.append(row(ctx, metric, cond, samples, peer, peer_kind="bound", target=target,
                        kernel=res[ctx.tandem_names()[0]][-1]["attention"][0].get("kernel")))
    return rows


def cells() -> list[Cell]:
    from engine.bench import suite_cpu_quant, suite_gpu

    return [
        Cell("cpu-builtin", "Built-in SmolLM2-135M on the CPU, same GGUF (Q4_1)", "cpu",
             "decode ≥ 50% of llama.cpp", cell_cpu_builtin),
        Cell("cpu-builtin-moe", "The app's default model (the built-in GGUF upcycled into 8 experts at load) on the "
             "CPU; llama.cpp runs the same GGUF as it is", "cpu", "decode ≥ 80% of llama.cpp",
             lambda ctx: cell_cpu_builtin(ctx, "builtin:smollm2-135m-moe")),
        Cell("cpu-kernels", "Native CPU kernels against the STREAM read", "cpu",
             "per row", cell_cpu_kernels),
        Cell("cpu-busy-core", "Built-in SmolLM2-135M on the CPU with a core busy with another program", "cpu",
             "decode ≥ 1× llama.cpp", cell_cpu_busy_core),
        *suite_cpu_quant.cells(),
        *suite_gpu.cells(),
    ]


# ---- the suite ----------------------------------------------------------------------------------

def git(*args, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def this_tree() -> Tree:
    try:
        changed = [x for x in git("status", "--porcelain", "--untracked-files=no").splitlines() if x.strip()]
        return Tree("this", REPO, git("rev-parse", "HEAD"), dirty=len(changed))
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an installed bundle): no commit to name
        return Tree("this", REPO, "unknown")


def add_worktree(commit: str, progress=print) -> Tree:
    """A detached git worktree of `commit` in a temp dir, with the native extension it needs: this
    tree's build when native/ and setup.py are the same at both, else built there."""
    sha = git("rev-parse", "--verify", commit + "^{commit}")
    path = Path(tempfile.mkdtemp(prefix=f"tandem-ab-{sha[:8]}-"))
    git("worktree", "add", "--detach", str(path), sha)
    same_native = subprocess.run(["git", "diff", "--quiet", sha, "--", "native", "setup.py"], cwd=REPO).returncode == 0
    built = sorted((REPO / "engine").glob("_native*.so"))
    if same_native and built:
        for so in built:
            shutil.copy2(so, path / "engine" / so.name)
    else:
        progress(f"[suite] building the native extension of {sha[:8]} (native/ differs)")
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=path, capture_output=True,
                       check=False)
    return Tree("against", path, sha)


def remove_worktree(tree: Tree) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(tree.path)], cwd=REPO, capture_output=True)
    shutil.rmtree(tree.path, ignore_errors=True)


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def run_cells(ctx: Ctx, selected: list[Cell]) -> list[dict]:
    cuda = has_cuda()
    out = []
    for cell in selected:
        entry = {"id": cell.id, "title": cell.title, "needs": cell.needs, "target": cell.target,
                 "command": f"tandem bench suite --cells {cell.id}" + (" --quick" if ctx.quick else ""),
                 "status": "ran", "reason": None, "rows": []}
        t0 = time.perf_counter()
        try:
            if cell.needs == "cuda" and not cuda:
                raise Skip("no CUDA device")
            ctx.progress(f"[suite] {cell.id}: {cell.title}")
            entry["rows"] = cell.run(ctx)
        except Skip as e:
            entry.update(status="skipped", reason=str(e))
        except Exception as e:  # a failing cell is reported; the others still run
            entry.update(status="failed", reason=f"{type(e).__name__}: {str(e)[-600:]}")
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        ctx.progress(f"[suite] {cell.id}: {entry['status']} in {entry['seconds']} s"
                     + (f" ({entry['reason']})" if entry["reason"] else ""))
        out.append(entry)
    return out


def run(*, quick: bool = False, rounds: int | None = None, cell_ids: list[str] | None = None,
        against: str | None = None, threads: int | None = None, routings: tuple | None = None,
        work: str | None = None, llama_source: str | None = None, tokenizer_from: str | None = None,
        contexts: tuple | None = None, chats: tuple | None = None, progress=print) -> dict:
    all_cells = cells()
    known = {c.id for c in all_cells}
    if cell_ids:
        unknown = sorted(set(cell_ids) - known)
        if unknown:
            raise ValueError(f"unknown cells {unknown}; the cells are: {', '.join(sorted(known))}")
        selected = [c for c in all_cells if c.id in cell_ids]
    else:
        selected = [c for c in all_cells if c.needs == "cpu" and c.in_quick] if quick else all_cells
    trees = [this_tree()]
    if against:
        trees.append(add_worktree(against, progress))
    ctx = Ctx(trees=trees, rounds=rounds or 3, quick=quick, threads=threads, progress=progress,
              routings=tuple(routings or ("random", "zipf:1.0")), llama_source=llama_source,
              tokenizer_from=tokenizer_from, contexts=contexts, chats=chats,
              **({"work": Path(work)} if work else {}))
    ctx.work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    try:
        results = run_cells(ctx, selected)
    finally:
        if against:
            remove_worktree(trees[1])
    return {**header(), "bench": "suite", "quick": quick, "rounds": ctx.rounds, "routings": list(ctx.routings),
            "contexts": list(contexts) if contexts else None, "chats": list(chats) if chats else None,
            "trees": [{"label": t.label, "commit": t.commit, "files_changed": t.dirty} for t in trees],
            # the machine may be shared: the 1-minute load average before and after says how much
            "load_average": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
            "seconds": round(time.perf_counter() - t0, 1), "cells": results}


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="the CPU cells only, shorter runs")
    p.add_argument("--cells", default=None, help="comma list of cell ids (default: every cell; --quick: the CPU ones)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per cell, systems taking turns (default 3)")
    p.add_argument("--against", default=None, metavar="COMMIT",
                   help="also measure a git worktree of COMMIT, alternated with this tree; rows gain the A/B ratio")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--routing", default="random,zipf:1.0",
                   help="routings of the cells that offload experts (random, zipf[:exponent]): each is reported")
    p.add_argument("--work", default=None, help="folder for GGUF exports and the llama.cpp build (kept between runs)")
    p.add_argument("--llama-cpp-source", default=None,
                   help="llama.cpp sources for the GPU cells' llama-bench build (sdist, pruned tarball or folder)")
    p.add_argument("--tokenizer-from", default=None,
                   help="a GGUF whose tokenizer the GPU cells' exports carry (default: the built-in SmolLM2's)")
    p.add_argument("--contexts", default=None,
                   help="comma list: only these of the GPU decode cells' contexts (e.g. 2048; default: each cell's own)")
    p.add_argument("--chats", default=None,
                   help="comma list: only these of the GPU decode cells' chat counts (e.g. 1; default: each cell's own)")
    p.add_argument("--json", default=None, help="write the record here (and the markdown table beside it)")
    p.add_argument("--markdown", default=None, help="write the markdown table here (default: --json with .md)")


def from_args(ns) -> dict:
    from engine.bench import suite_table

    record = run(quick=ns.quick, rounds=ns.rounds, cell_ids=ns.cells.split(",") if ns.cells else None,
                 against=ns.against, threads=ns.threads, routings=tuple(ns.routing.split(",")), work=ns.work,
                 llama_source=ns.llama_cpp_source, tokenizer_from=ns.tokenizer_from,
                 contexts=tuple(int(c) for c in ns.contexts.split(",")) if ns.contexts else None,
                 chats=tuple(int(c) for c in ns.chats.split(",")) if ns.chats else None,
                 progress=lambda m: print(m, file=sys.stderr, flush=True))
    md = ns.markdown or (str(Path(ns.json).with_suffix(".md")) if ns.json else None)
    if md:
        Path(md).write_text(suite_table.markdown(record, record_path=ns.json))
    return record
