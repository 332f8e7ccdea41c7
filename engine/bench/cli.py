"""`tandem bench …`: the benchmark subcommands of engine/cli.py. Each writes one JSON record;
`suite`, `kv`, `e2e`, `experts`, `transformers`, `serve` and `soak` parse their own flags."""

from __future__ import annotations

import argparse
import sys

from engine.errors import TandemError

OWN_FLAGS = ("kv", "experts", "e2e", "transformers", "suite")


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="run a benchmark, print (and save) its JSON record")
    b.add_argument("kind", help="suite | builtin | cpu-kernels | kv | e2e | experts | transformers | serve (these six: `tandem bench kv --help`)")
    b.add_argument("--json", default=None, help="also write the record here")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--new-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=3)
    # cpu-kernels (native CPU attention and expert kernels next to STREAM and torch):
    b.add_argument("--thread-counts", default=None, help="cpu-kernels: e.g. 1,2,4,8,15,16 (default: 1…all cores)")
    b.add_argument("--lengths", default=None, help="cpu-kernels: KV lengths, e.g. 2k,8k,32k (default: 2k…64k)")
    b.add_argument("--batches", default=None, help="cpu-kernels: sequences per step (default: 1,4)")
    b.add_argument("--tokens", default=None, help="cpu-kernels: tokens per expert (default: 1,2,4,…,256)")
    b.add_argument("--moe-tokens", default=None, help="cpu-kernels moe: tokens per expert of a layer (default: 1,4)")
    b.add_argument("--quick", action="store_true", help="cpu-kernels: fewer lengths, smaller buffers")
    b.add_argument("--no-torch-sdpa", action="store_true", help="cpu-kernels: skip torch's CPU attention")
    b.add_argument("--sections", default=None, help="cpu-kernels: e.g. moe or experts,moe (default: "
                   "stream,attention,experts,moe)")
    b.set_defaults(func=cmd_bench)


def command(argv: list[str]):
    """The bench command that parses its own flags, as a callable, or None for the others."""
    if argv[:2] == ["bench", "serve"]:
        return lambda: cmd_bench_serve(argv[2:])
    if argv[:2] == ["bench", "soak"]:
        return lambda: cmd_bench_soak(argv[2:])
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in OWN_FLAGS:
        return lambda: cmd_bench_own_flags(argv[1], argv[2:])
    return None


def cmd_bench(args) -> int:
    from engine.bench.common import write_json

    if args.kind == "builtin":
        from engine.bench import builtin
        record = builtin.run(threads=args.threads, new_tokens=args.new_tokens, repeats=args.repeats)
    elif args.kind == "cpu-kernels":
        from engine.bench import cpu_kernels as ck
        record = ck.run(threads=ck.parse_list(args.thread_counts), lengths=ck.parse_list(args.lengths),
                        batches=ck.parse_list(args.batches), tokens=ck.parse_list(args.tokens), quick=args.quick,
                        moe_tokens=ck.parse_list(args.moe_tokens),
                        repeats=args.repeats, torch_sdpa=not args.no_torch_sdpa,
                        sections=args.sections.split(",") if args.sections else None,
                        progress=lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True))
    else:
        raise TandemError(f"unknown benchmark '{args.kind}'", "available: builtin, cpu-kernels, kv, experts")
    write_json(record, args.json)
    return 0


def cmd_bench_soak(argv: list[str]) -> int:
    """`tandem bench soak`: a long hybrid decode checked against resident, resources sampled."""
    from engine.bench import soak
    from engine.bench.common import write_json

    p = argparse.ArgumentParser(prog="tandem bench soak")
    p.add_argument("--steps", type=int, default=10_000, help="decode steps in all")
    p.add_argument("--window", type=int, default=500, help="steps per checked window (one sequence each)")
    p.add_argument("--d-window", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--expert-cache-slots", type=int, default=48)
    p.add_argument("--model", default="builtin:smollm2-135m-moe")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None, help="write the record here")
    a = p.parse_args(argv)
    record = soak.run(steps=a.steps, window=a.window, d_window=a.d_window, block_size=a.block_size,
                      expert_cache_slots=a.expert_cache_slots, model=a.model, device=a.device,
                      progress=lambda s: print(f"[soak] {s}", file=sys.stderr, flush=True))
    write_json(record, a.json)
    ok = all(w["ok"] for w in record["windows"]) and record["growth"].get("ok", True)
    return 0 if ok else 1


def cmd_bench_own_flags(kind: str, argv: list[str]) -> int:
    """`tandem bench kv|e2e|experts|transformers|suite …`: these benchmarks parse their own flags."""
    from engine.bench import e2e, experts, kv, suite, transformers_peer
    from engine.bench.common import write_json

    mod = {"kv": kv, "e2e": e2e, "transformers": transformers_peer, "experts": experts, "suite": suite}[kind]
    p = argparse.ArgumentParser(prog=f"tandem bench {kind}")
    mod.add_arguments(p)
    ns = p.parse_args(argv)
    write_json(mod.from_args(ns), ns.json)
    return 0


def cmd_bench_serve(argv: list[str]) -> int:
    """`tandem bench serve …`: a bounded load test of `tandem serve` on loopback (engine/bench/serve_load.py)."""
    from engine.bench import serve_load
    from engine.bench.common import write_json

    p = argparse.ArgumentParser(prog="tandem bench serve")
    serve_load.add_arguments(p)
    ns = p.parse_args(argv)
    record = serve_load.run(ns.model, ns.url, ns.api_key, ns.clients, ns.duration, ns.max_tokens, ns.server_args,
                            log=lambda s: print(s, file=sys.stderr, flush=True))
    write_json(record, ns.json)
    return 0
