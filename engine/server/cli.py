"""`tandem serve`'s subcommand: its options (address, key, limits) and the run of the server over one
engine. engine/cli.py adds the engine's own flags to the parser and hands over the EngineConfig they
make; nothing here imports the server's dependencies until the command runs."""

from __future__ import annotations

import argparse
import os
import sys


def add_serve_parser(sub) -> argparse.ArgumentParser:
    """The `serve` subparser with the server's options → it, for the caller's engine flags."""
    s = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="0: any free port")
    s.add_argument("--api-key", default=None, help="the key clients send as 'Authorization: Bearer KEY' "
                   "(default: $TANDEM_API_KEY). On a shared machine use the variable: other users can read "
                   "a process's command line")
    s.add_argument("--max-request-bytes", type=int, default=2**20, help="larger request bodies get 413")
    s.add_argument("--rate-limit", type=int, default=600, help="requests a minute per client address (0: off)")
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests beyond this get 429")
    s.add_argument("--default-max-tokens", type=int, default=512, help="reply length when a request names none")
    s.add_argument("--time-limit", type=float, default=600.0,
                   help="seconds a generation may run, from its start; its reply then ends (0: none)")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds for a request's line and headers to arrive, else 408 and closed (0: none)")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may pause between pieces, else 408 and closed")
    s.add_argument("--max-connections", type=int, default=32,
                   help="open connections per client address; more get 429 and are closed (0: no cap)")
    s.add_argument("--log-level", default="warning", help="uvicorn's: warning | info | debug")
    s.add_argument("--quiet", action="store_true", help="no loading progress on stderr")
    return s


def serve_command(args, config, progress) -> int:
    """`tandem serve`: the OpenAI-compatible server (engine/server/app.py) over one engine of
    `config` (an EngineConfig); progress: the loading progress callback, or None."""
    from engine.api import Engine
    from engine.errors import TandemError
    from engine.server.app import ServerSettings, serve, served_model_id

    key = args.api_key or os.environ.get("TANDEM_API_KEY")
    if not key:
        raise TandemError("tandem serve needs an API key",
                          "pass --api-key KEY or set TANDEM_API_KEY (e.g. from: python3 -c "
                          "'import secrets; print(secrets.token_urlsafe(32))')")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {args.host}: other machines can reach this server (the key still applies)",
              file=sys.stderr)
    engine = Engine(config, progress=progress)
    if args.api_key:
        print("warning: --api-key puts the key in this process's command line, which other users of this "
              "machine can read (ps); prefer TANDEM_API_KEY", file=sys.stderr)
    settings = ServerSettings(api_key=key, model_id=served_model_id(args.model),
                              max_request_bytes=args.max_request_bytes, rate_limit_per_min=args.rate_limit,
                              max_queue=args.max_queue, default_max_tokens=args.default_max_tokens,
                              time_limit_s=args.time_limit, header_timeout_s=args.header_timeout,
                              body_timeout_s=args.body_timeout, max_connections_per_address=args.max_connections)
    shown = f"[{args.host}]" if ":" in args.host else args.host

    def ready(server, at_once: int) -> None:
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
        why = (engine.info().get("plan") or {}).get("chats_reason")  # where the plan chose how many
        # "Tandem serving MODEL at URL " is what the app's server control reads (app/server_control.py READY)
        print(f"Tandem serving {settings.model_id} at http://{shown}:{port}/v1 · {at_once} "
              f"{'request' if at_once == 1 else 'requests'} at once{f' ({why})' if why else ''} (Ctrl-C stops)",
              file=sys.stderr, flush=True)

    try:
        serve(engine, settings, host=args.host, port=args.port, log_level=args.log_level, ready=ready)
    finally:
        engine.close()
    return 0
