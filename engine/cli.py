"""`tandem …` subcommands. Generated text goes to stdout; logs and errors go to stderr."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from dataclasses import fields

from engine.errors import TandemError


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Every EngineConfig field as a --flag (model's default: the built-in MoE model)."""
    from engine.api import EngineConfig

    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", default=f.default)
        else:
            kind = {"int | None": int, "int": int, "float | None": float}.get(str(f.type), str)
            p.add_argument(flag, type=kind, default=f.default, help=f"(default: {f.default})")


def _config(args):
    from engine.api import EngineConfig

    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


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


def cmd_generate(args) -> int:
    from engine.api import Engine, GenerationRequest

    engine = Engine(_config(args), progress=None if args.quiet else _progress)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    req = GenerationRequest(prompt=prompt, raw=args.raw, **_sampling(args))
    result = engine.generate(req, on_text=lambda t: print(t, end="", flush=True))
    print(flush=True)
    if not args.quiet:
        print(f"[{result.completion_tokens} tokens, {result.finish_reason}; prefill "
              f"{result.prefill_tok_s or 0:.1f} tok/s, decode {result.decode_tok_s or 0:.1f} tok/s]",
              file=sys.stderr)
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            f.write(engine.stats().to_json(indent=2))
    engine.close()
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
            result = engine.generate(req, on_text=lambda t: print(t, end="", flush=True), stop_event=stop)
        except KeyboardInterrupt:
            stop.set()
            print("\n[stopped]", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": result.text})
    engine.close()
    return 0


def cmd_models(args) -> int:
    from engine.models.builtin import BUILTINS, DEFAULT_MODEL

    for key, b in BUILTINS.items():
        name = f"builtin:{key}"
        print(f"{name:<28} {b.description}{'  [default]' if name == DEFAULT_MODEL else ''}")
    print("Also: a path to a .gguf file, or a Hugging Face model folder (config.json + *.safetensors).")
    return 0


def cmd_gui(args) -> int:
    try:
        from app.main import main as app_main
    except ImportError as e:
        raise TandemError(f"the desktop app cannot start ({e})", "install the app's dependencies: pip install -e .")
    return app_main(list(getattr(args, "app_args", None) or []))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Private MoE chat on one GPU plus the CPU.")
    sub = parser.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--prompt", default=None, help="the prompt (default: read stdin)")
    g.add_argument("--raw", action="store_true", help="feed the prompt as it is, without the chat template")
    g.add_argument("--stats-json", default=None, help="write the final StatsSnapshot here")
    g.add_argument("--quiet", action="store_true", help="no progress or timing lines on stderr")
    _add_sampling_flags(g)
    _add_engine_flags(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="chat in the terminal")
    c.add_argument("--system", default=None, help="system prompt")
    _add_sampling_flags(c)
    _add_engine_flags(c)
    c.set_defaults(func=cmd_chat)

    sub.add_parser("models", help="list the built-in models").set_defaults(func=cmd_models)
    # The app parses its own options (--model, --data-dir, …; `tandem gui --help` lists them).
    sub.add_parser("gui", help="open the desktop app", add_help=False).set_defaults(func=cmd_gui)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "gui":
        args.app_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        args.func = cmd_gui
    try:
        return args.func(args)
    except TandemError as e:
        print(f"error: {e.what}", file=sys.stderr)
        if e.remedy:
            print(f"what to do: {e.remedy}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
