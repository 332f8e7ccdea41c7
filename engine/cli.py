"""`tandem …` subcommands. Generated text goes to stdout; logs and errors go to stderr."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from dataclasses import fields

from engine.bench.cli import add_bench_parser
from engine.bench.cli import command as bench_command
from engine.errors import TandemError
from engine.server.cli import add_serve_parser, serve_command


def _add_engine_flags(p: argparse.ArgumentParser, helps: dict[str, str] | None = None) -> None:
    """Every EngineConfig field as a --flag (model's default: the built-in MoE model). helps: a field's
    help where the command sets its default itself (the flag's default is then None)."""
    from engine.api import EngineConfig

    helps = helps or {}
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool) and f.default:  # on by default: the flag turns it off
            p.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false", default=True)
        elif f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", default=f.default)
        else:
            kind = {"int | None": int, "int": int, "float | None": float}.get(str(f.type), str)
            own = f.name in helps
            p.add_argument(flag, type=kind, default=None if own else f.default,
                           help=helps[f.name] if own else f"(default: {f.default})")


# max_batch's help where a command runs its own sequences: generate's --batch, chat's one conversation
RUN_SEQUENCES = {"max_batch": "sequences whose KV is held (default: the sequences this command runs)"}
# … and where it serves chats as they come (plan shows what serve and the app would hold)
HELD_CHATS = {"max_batch": "chats whose KV is held (default: as many as the plan holds without slowing "
                           "the chat in use, up to 4)"}


def _config(args):
    """The flags as an EngineConfig. A command that runs its own sequences (generate, chat) holds their KV
    and no more: KV held for chats that never come takes memory the chat in use could be read from.
    The others leave max_batch to the plan (sched/placement.py held_chats)."""
    from engine.api import EngineConfig

    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig)}
    if values["max_batch"] is None and getattr(args, "runs_own_sequences", False):
        values["max_batch"] = getattr(args, "batch", 1)
    return EngineConfig(**values)


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                seed=args.seed, stop=args.stop)


def _progress(step: str, frac: float) -> None:
    print(f"[{frac:4.0%}] {step}", file=sys.stderr, flush=True)


class ReplyPrinter:
    """Streams a reply to stdout; a reasoning model's reasoning is headed "[reasoning]" and its answer,
    which follows, "[answer]", so neither reads as the other (a plain reply prints as it is)."""

    def __init__(self):
        self.kind = None  # what was printed last: "reasoning", "answer", or None before anything

    def __call__(self, piece: str) -> None:
        from engine.api import Reasoning

        kind = "reasoning" if isinstance(piece, Reasoning) else "answer"
        if kind != self.kind and (kind == "reasoning" or self.kind is not None):
            print(("\n" if self.kind else "") + f"[{kind}]", flush=True)
        self.kind = kind
        print(piece, end="", flush=True)


def cmd_generate(args) -> int:
    from engine.api import Engine, GenerationRequest

    engine = Engine(_config(args), progress=None if args.quiet else _progress)
    if args.prompt_ids is not None or args.random_prompt or args.batch > 1:
        return _generate_batch_of_ids(args, engine)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    req = GenerationRequest(prompt=prompt, raw=args.raw, **_sampling(args))
    result = engine.generate(req, on_text=ReplyPrinter())
    print(flush=True)
    if not args.quiet:
        print(f"[{result.completion_tokens} tokens, {result.finish_reason}; prefill "
              f"{result.prefill_tok_s or 0:.1f} tok/s, decode {result.decode_tok_s or 0:.1f} tok/s]",
              file=sys.stderr)
    return _finish(args, engine)


def _finish(args, engine) -> int:
    """The stats to --stats-json when asked, then the engine closed: how every generate ends."""
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            f.write(engine.stats().to_json(indent=2))
    engine.close()
    return 0


def _generate_batch_of_ids(args, engine) -> int:
    """`--batch B` sequences decoded together from token ids (`--prompt-ids`, `--random-prompt N`, or
    the prompt text): what benchmarks of tokenizer-less (synthetic) models run. One line per
    sequence on stdout: its text, or its token ids when the model has no tokenizer."""
    import random

    from engine.api import GenerationRequest

    if args.prompt_ids is not None:
        prompts = [[int(t) for t in args.prompt_ids.replace(",", " ").split()]] * args.batch
    elif args.random_prompt:
        vocab = engine.info()["vocab_size"]
        prompts = [[random.Random(1000 + b).randrange(vocab) for _ in range(args.random_prompt)]
                   for b in range(args.batch)]  # a different fixed prompt per sequence
    else:
        text = args.prompt if args.prompt is not None else sys.stdin.read()
        prompts = [engine.prompt_ids(GenerationRequest(prompt=text, raw=args.raw))] * args.batch
    sampling = _sampling(args)
    requests = [GenerationRequest(prompt_ids=p, **{**sampling, "seed": None if args.seed is None else args.seed + b})
                for b, p in enumerate(prompts)]
    results = engine.generate_batch(requests)
    for r in results:
        print(r.text if engine.tokenizer is not None else " ".join(map(str, r.token_ids)), flush=True)
    if not args.quiet:
        r = results[0]
        print(f"[{len(results)} × {r.prompt_tokens} prompt tokens → {sum(x.completion_tokens for x in results)} tokens; "
              f"prefill {r.prefill_tok_s or 0:.1f} tok/s, decode {r.decode_tok_s or 0:.1f} tok/s (all sequences); "
              f"loaded in {engine.info()['load_s']:.1f} s]", file=sys.stderr)
    return _finish(args, engine)


def cmd_plan(args) -> int:
    """The placement plan as a table (or JSON), from the model's headers; exit 1 when it cannot fit."""
    from engine.api import plan_placement

    p = plan_placement(_config(args))
    if args.json:
        print(json.dumps(p, indent=2))
        return 0 if p["fits"] else 1
    gib = lambda n: f"{n / 2**30:8.2f} GiB"
    print(f"model      {args.model}")
    print(f"machine    VRAM {gib(p['vram_available'])} · RAM {gib(p['ram_available'])} · costs: {p['costs_source']}")
    if not p["fits"]:
        print(f"does not fit: {p['problem']}\n{p['remedy']}")
        return 1
    device = p["device"] + (" (simulated on the CPU)" if p["simulated"] and p["device"] == "gpu" else "")
    print(f"placement  device {device} · kv_policy {p['kv_policy']} · expert_policy {p['expert_policy']}"
          + (f" · {p['expert_cache_slots']} expert slots" if p["expert_cache_slots"] is not None else "")
          + (f" · D-window {p['d_window']}, r {p['r_start']:.2f} at the full context" if p["r_start"] is not None else ""))
    print(f"context    {p['max_context']:,} tokens × {p['max_batch']} chats; KV on the GPU: {p['kv_gpu_tokens']:,} tokens a chat")
    if p["chats_reason"]:
        print(f"chats      {p['chats_reason']}")
    print()
    print(f"{'part':<44} {'where':<5} {'size':>12}")
    for row in p["rows"]:
        print(f"{row['part']:<44} {row['where']:<5} {gib(row['bytes']):>12}")
    print(f"{'total on the GPU':<44} {'':<5} {gib(p['vram_bytes']):>12}")
    print(f"{'total in RAM':<44} {'':<5} {gib(p['ram_bytes']):>12}")
    print()
    print(f"predicted  decode {p['decode_tok_s']:.1f} tok/s (one chat, full context; {p['decode_tok_s_short']:.1f} "
          f"at its start; {p['decode_tok_s_all']:.1f} for {p['max_batch']} chats together) · prefill "
          f"{p['prefill_tok_s']:.0f} tok/s")
    print(f"bottleneck {p['bottleneck']}")
    print(f"why        {p['reason']}")
    return 0


def cmd_chat(args) -> int:
    from engine.api import Engine, GenerationRequest

    engine = Engine(_config(args), progress=_progress)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Tandem chat — an empty line or Ctrl-D ends; Ctrl-C stops a reply.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        stop = threading.Event()
        req = GenerationRequest(messages=list(messages), session_id="repl", **_sampling(args))
        try:
            result = engine.generate(req, on_text=ReplyPrinter(), stop_event=stop)
        except KeyboardInterrupt:
            stop.set()
            print("\n[stopped]", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": result.text})  # the answer alone: harmony drops past reasoning
    engine.close()
    return 0


def cmd_models(args) -> int:
    from engine.models.builtin import BUILTINS, DEFAULT_MODEL

    for key, b in BUILTINS.items():
        name = f"builtin:{key}"
        print(f"{name:<28} {b.description}{'  [default]' if name == DEFAULT_MODEL else ''}")
    from engine.models.synthetic import PRESETS

    for key, config in PRESETS.items():
        print(f"{'synthetic:' + key:<28} random weights in the shape of {config['model_type']} "
              f"({config['num_hidden_layers']} layers; -L<n> for the first n, then -Q4_0 or -Q8_0 for "
              "experts in blocks); token ids only")
    print("Also: a path to a .gguf file, or a Hugging Face model folder (config.json + *.safetensors).")
    return 0


def cmd_calibrate(args) -> int:
    from engine.api import calibrate
    from engine.hw.report import table

    if args.cpu_threads:
        import torch

        from engine.kernels import native

        torch.set_num_threads(args.cpu_threads)
        native.set_threads(args.cpu_threads)  # the engine's own CPU kernels are the ones measured
    mode = "full" if args.full else "quick"
    data = calibrate(mode, None if args.quiet else _progress, args.profile_path, model=args.model,
                     device=args.device, dtype=args.dtype)
    from engine.hw.profile import resolve_path

    print(table(data, data["calibrated_shape"]))
    print(f"saved to {resolve_path(args.profile_path)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        print(f"JSON written to {args.json}", file=sys.stderr)
    return 0


def cmd_gui(args) -> int:
    try:
        from app.main import main as app_main
    except ImportError as e:
        raise TandemError(f"the desktop app cannot start ({e})", "install the app's dependencies: pip install -e .")
    return app_main(list(getattr(args, "app_args", None) or []))


def cmd_serve(args) -> int:
    """`tandem serve` (engine/server/cli.py) over an engine of these flags."""
    return serve_command(args, _config(args), None if args.quiet else _progress)


def cmd_export_gguf(args) -> int:
    from engine.bench import gguf_export
    from engine.bench.common import write_json

    progress = None if args.quiet else (lambda step, frac: print(f"[{frac:4.0%}] {step}", file=sys.stderr, flush=True))
    stats = gguf_export.export(args.model, args.out, dtype=args.dtype, device=args.device, seed=args.seed,
                               tokenizer_from=args.tokenizer_from, progress=progress)
    stats["gb_per_s"] = round(stats["bytes"] / 1e9 / stats["seconds"], 3)
    write_json(stats, None)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Private MoE chat on one GPU plus the CPU.")
    sub = parser.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--prompt", default=None, help="the prompt (default: read stdin)")
    g.add_argument("--raw", action="store_true", help="feed the prompt as it is, without the chat template")
    g.add_argument("--stats-json", default=None, help="write the final StatsSnapshot here")
    g.add_argument("--quiet", action="store_true", help="no progress or timing lines on stderr")
    g.add_argument("--prompt-ids", default=None, help="the prompt as token ids, e.g. '1,2,3' (no template)")
    g.add_argument("--random-prompt", type=int, default=None, metavar="N",
                   help="a fixed pseudo-random prompt of N token ids per sequence (benchmarks)")
    g.add_argument("--batch", type=int, default=1, metavar="B",
                   help="decode B sequences together (needs max_batch ≥ B); prints one line each")
    _add_sampling_flags(g)
    _add_engine_flags(g, RUN_SEQUENCES)
    g.set_defaults(func=cmd_generate, runs_own_sequences=True)

    c = sub.add_parser("chat", help="chat in the terminal")
    c.add_argument("--system", default=None, help="system prompt")
    _add_sampling_flags(c)
    _add_engine_flags(c, RUN_SEQUENCES)
    c.set_defaults(func=cmd_chat, runs_own_sequences=True)

    sub.add_parser("models", help="list the built-in models").set_defaults(func=cmd_models)

    pl = sub.add_parser("plan", help="show where a model would live on this machine and how fast it would run "
                                     "(reads headers only; exit 1 when it cannot fit)")
    _add_engine_flags(pl, HELD_CHATS)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=cmd_plan)

    from engine.models.builtin import DEFAULT_MODEL

    k = sub.add_parser("calibrate", help="measure this machine (bandwidths, attention and expert costs) and save the profile")
    speed = k.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true", help="under a minute (the default)")
    speed.add_argument("--full", action="store_true", help="every transfer size, two batch sizes, long contexts")
    k.add_argument("--model", default=DEFAULT_MODEL, help="whose KV and expert shape to measure (builtin:…, "
                   "synthetic:…, a .gguf file or a model folder; only its metadata is read)")
    k.add_argument("--json", default=None, metavar="PATH", help="also write the profile JSON here")
    k.add_argument("--profile-path", default=None, help="profile file (default: the user data dir)")
    k.add_argument("--device", default="auto", help="auto | cuda | cpu (cpu: a CPU-only profile)")
    k.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (auto: bf16 with CUDA; without, fp32 with an fp16 KV cache)")
    k.add_argument("--cpu-threads", type=int, default=None, help="threads for the CPU kernels (torch's and the native ones)")
    k.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    k.set_defaults(func=cmd_calibrate)
    # The app parses its own options (--model, --data-dir, …; `tandem gui --help` lists them).
    sub.add_parser("gui", help="open the desktop app", add_help=False).set_defaults(func=cmd_gui)

    add_bench_parser(sub)
    s = add_serve_parser(sub)
    _add_engine_flags(s, HELD_CHATS)
    s.set_defaults(func=cmd_serve)

    x = sub.add_parser("export-gguf", help="write a model as a GGUF file for llama.cpp (same weights, BF16)")
    x.add_argument("--model", required=True, help="synthetic:…, a model folder or a .gguf")
    x.add_argument("--out", required=True, help="the .gguf file to write")
    x.add_argument("--dtype", default="bf16", help="bf16 | f32 (matrices; norms and routers are always F32)")
    x.add_argument("--device", default="cpu", help="where synthetic weights are drawn (cuda: the numbers "
                   "Tandem draws on a GPU)")
    x.add_argument("--seed", type=int, default=None, help="synthetic models' seed (default: Tandem's)")
    x.add_argument("--tokenizer-from", default=None, help="a GGUF whose tokenizer.* keys to copy "
                   "(default: the model's own, else the built-in SmolLM2's)")
    x.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    x.set_defaults(func=cmd_export_gguf)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench = bench_command(argv)  # the benchmarks that parse their own flags
    if bench is not None:
        return _guarded(bench)
    if argv[:1] and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["gui", *argv]  # `tandem --data-dir X`: the app's own options without the word `gui`
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "gui":
        args.app_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        args.func = cmd_gui
    return _guarded(lambda: args.func(args))


def _guarded(run) -> int:
    """Errors meant for the user: what happened and what to do, no traceback."""
    try:
        return run()
    except TandemError as e:
        print(f"error: {e.what}", file=sys.stderr)
        if e.remedy:
            print(f"what to do: {e.remedy}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
