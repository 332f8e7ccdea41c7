"""`tandem bench serve`: a bounded load test of `tandem serve` on loopback.

For each client count (`--clients 1,4,8,16`), N clients stream chat completions back to back for a
fixed time (each starts its next request as its last one ends; no new request starts after the
deadline, the ones in flight finish). Requests mix short ones (a one-line question, `--max-tokens`)
and long ones (LONG_SHARE of them: a ~700-token prompt, so its prefill is chunked, and twice the
reply), and LEAVE_SHARE of them disconnect after a few chunks, as impatient clients do (seeded:
the same mix every run). Per request: time to first token (request sent → first text chunk, as the
client sees it), the mean time between its later chunks (one decode step at that load), total
latency, tokens, errors by status. A well-formed request that fails is an error; one that left is
counted apart and must show up as cancelled on the server.

The checks recorded beside the figures (continuous batching's promises): no error at any count;
p90 TTFT of short requests at 8 clients ≤ 2 × one decode step at 8 clients + their own prefill
(TTFT at 1 client); tokens/s at 4 clients ≥ 2 × at 1 client. The server is started here once, on
a free loopback port (or `--url` points at a running one), and its counters (/v1/tandem/stats)
are recorded per count.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

from engine.bench.common import header

PROMPTS = ["Tell me a short story about a lighthouse.", "What is the capital of France?",
           "List three uses of copper.", "Explain what a prime number is.", "Write a haiku about rain.",
           "Why is the sky blue?", "Give me a tip for learning to cook.", "Describe a cat in one sentence."]
LONG_PROMPT = ("Here are my notes from the week; summarise them in two sentences. " +
               " ".join(f"On day {i} the team met, reviewed the open issues, fixed {i % 5 + 1} of them "
                        f"and wrote down what to try next." for i in range(28)))  # ~700 tokens
LONG_SHARE = 0.25  # of requests: the long prompt, twice the reply
LEAVE_SHARE = 0.2  # of requests: the client disconnects after LEAVE_AFTER chunks
LEAVE_AFTER = 3
SEED = 0


def add_arguments(p) -> None:
    p.add_argument("--model", default="builtin:smollm2-135m", help="what `tandem serve` loads")
    p.add_argument("--url", default=None, help="load an already running server instead (its /v1 address)")
    p.add_argument("--api-key", default=None, help="with --url: its key (default: $TANDEM_API_KEY)")
    p.add_argument("--clients", default="1,4,8,16", help="concurrent streaming clients, one run per count")
    p.add_argument("--duration", type=float, default=20.0, help="seconds during which requests are started, per count")
    p.add_argument("--max-tokens", type=int, default=16, help="reply length of a short request (EOS ignored)")
    p.add_argument("--server-args", default="--device cpu --cpu-threads 2 --max-batch 16 --max-context 2048",
                   help="extra `tandem serve` flags when this command starts the server")
    p.add_argument("--json", default=None, help="also write the record here")


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summary(xs: list[float]) -> dict:
    r = lambda v: None if v is None else round(v, 4)  # noqa: E731
    return {"n": len(xs), "mean": r(statistics.fmean(xs)) if xs else None, "p50": r(percentile(xs, 0.5)),
            "p90": r(percentile(xs, 0.9)), "p99": r(percentile(xs, 0.99)), "max": r(max(xs)) if xs else None}


async def _one(http, url: str, index: int, kind: str, leave: bool, max_tokens: int) -> dict:
    prompt = LONG_PROMPT if kind == "long" else PROMPTS[index % len(PROMPTS)]
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "ignore_eos": True,
            "max_tokens": max_tokens * (2 if kind == "long" else 1), "temperature": 0.7,
            "stream_options": {"include_usage": True}}
    rec = {"client": index, "kind": kind, "leave": leave, "ok": False, "ttft_s": None, "status": None, "tokens": 0}
    t0, chunks, stamps = time.monotonic(), 0, []
    try:
        async with http.stream("POST", url + "/chat/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = (await r.aread()).decode(errors="replace")[:200]
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        rec["error"] = event["error"].get("message")
                        break
                    if event.get("usage"):
                        rec["tokens"] = event["usage"]["completion_tokens"]
                    for ch in event.get("choices") or []:
                        if ch.get("delta", {}).get("content"):
                            stamps.append(time.monotonic())
                            chunks += 1
                    if leave and chunks >= LEAVE_AFTER:
                        break  # leaving the block closes the connection mid-stream
                rec["ok"] = "error" not in rec and (leave or rec["tokens"] > 0)
    except Exception as e:  # noqa: BLE001 — a failed request is a result of a load test
        rec["error"] = f"{type(e).__name__}: {e}"
    if stamps:
        rec["ttft_s"] = stamps[0] - t0
        if len(stamps) > 2:
            rec["step_s"] = (stamps[-1] - stamps[0]) / (len(stamps) - 1)  # text chunks ≈ tokens
    rec["latency_s"] = time.monotonic() - t0
    return rec


async def _client(http, url, index, deadline, max_tokens, rng: random.Random, out: list[dict]) -> None:
    n = 0
    while time.monotonic() < deadline:
        kind = "long" if rng.random() < LONG_SHARE else "short"
        out.append(await _one(http, url, index + n, kind, rng.random() < LEAVE_SHARE, max_tokens))
        n += 1


async def _load(url: str, key: str, clients: int, duration: float, max_tokens: int) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, limits=limits,
                                 timeout=httpx.Timeout(10.0, read=600.0)) as http:
        out: list[dict] = []
        t0 = time.monotonic()
        rngs = [random.Random(SEED * 1000 + clients * 100 + i) for i in range(clients)]
        await asyncio.gather(*(_client(http, url, i, t0 + duration, max_tokens, rngs[i], out) for i in range(clients)))
        return out, time.monotonic() - t0


def _cell(recs: list[dict], wall: float, before: dict, after: dict) -> dict:
    done = [r for r in recs if r["ok"] and not r["leave"]]
    left = [r for r in recs if r["ok"] and r["leave"]]
    errors: dict[str, int] = {}
    for r in recs:
        if not r["ok"]:
            kind = str(r["status"]) if r["status"] and r["status"] != 200 else (r.get("error") or "?").split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
    tokens = sum(r["tokens"] for r in done)
    d = lambda k: (after.get(k) or 0) - (before.get(k) or 0)  # noqa: E731
    steps = d("steps")
    return {"requests": len(recs), "completed": len(done), "left_mid_stream": len(left), "errors": errors,
            "error_count": sum(errors.values()), "wall_s": round(wall, 3), "completion_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 3), "requests_per_s": round(len(done) / wall, 4),
            "ttft_s": {k: summary([r["ttft_s"] for r in done + left if r["kind"] == k and r["ttft_s"]])
                       for k in ("short", "long")},
            "step_s": summary([r["step_s"] for r in done if r.get("step_s")]),
            "latency_s": summary([r["latency_s"] for r in done]),
            "server": {"completed": d("completed"), "cancelled": d("cancelled"), "failed": d("failed"),
                       "rejected": d("rejected"), "steps": steps, "peak_batch": after.get("peak_batch"),
                       "mean_batch": round(d("_rows") / steps, 3) if steps and d("_rows") else None}}


def checks(cells: dict) -> dict:
    """The promises of continuous batching, from the cells measured."""
    out = {"no_errors": all(c["error_count"] == 0 for c in cells.values())}
    one, four, eight = cells.get("1"), cells.get("4"), cells.get("8")
    if one and eight and one["ttft_s"]["short"]["p90"] and eight["step_s"]["p50"]:
        bound = 2 * eight["step_s"]["p50"] + one["ttft_s"]["short"]["p90"]
        out["ttft_p90_8_clients_s"] = eight["ttft_s"]["short"]["p90"]
        out["ttft_bound_s"] = round(bound, 4)  # 2 × one decode step at 8 clients + own prefill (TTFT alone)
        out["ttft_ok"] = eight["ttft_s"]["short"]["p90"] <= bound
    if one and four and one["tokens_per_s"]:
        out["speedup_4_over_1"] = round(four["tokens_per_s"] / one["tokens_per_s"], 3)
        out["speedup_ok"] = out["speedup_4_over_1"] >= 2.0
    return out


def run(model: str, url: str | None, api_key: str | None, clients, duration: float, max_tokens: int,
        server_args: str, log=print) -> dict:
    import os
    import shlex

    import httpx

    from engine.server import launch

    counts = [int(c) for c in str(clients).split(",") if c.strip()]
    server = None
    if url is None:
        log(f"[bench] starting tandem serve --model {model} {server_args}")
        server = launch.start_tandem(model, shlex.split(server_args) + ["--quiet", "--rate-limit", "0",
                                                                        "--max-connections", "0"])
        url, key = server.url, server.api_key
    else:
        key = api_key or os.environ.get("TANDEM_API_KEY") or ""
    headers = {"Authorization": f"Bearer {key}"}

    def server_stats() -> dict:
        s = httpx.get(url + "/tandem/stats", headers=headers, timeout=30).json()
        srv = s.get("server", {})
        return {**srv, "_rows": (srv.get("mean_batch") or 0) * (srv.get("steps") or 0)}, s

    cells, load = {}, {}
    try:
        # one request of each kind first, so loading and first-call costs are not in the measurement
        for content in ("Hi", LONG_PROMPT):
            httpx.post(url + "/chat/completions", headers=headers, timeout=120,
                       json={"messages": [{"role": "user", "content": content}], "max_tokens": 4})
        for n in counts:
            before, _ = server_stats()
            log(f"[bench] {n} streaming clients for {duration:.0f} s")
            load_before = os.getloadavg()  # a shared machine: how busy it was is part of the result
            recs, wall = asyncio.run(_load(url, key, n, duration, max_tokens))
            after, stats = server_stats()
            cells[str(n)] = _cell(recs, wall, before, after)
            load[str(n)] = {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)}
            c = cells[str(n)]
            log(f"[bench]   {c['completed']} done, {c['left_mid_stream']} left, {c['error_count']} errors, "
                f"{c['tokens_per_s']} tok/s, TTFT p90 short {c['ttft_s']['short']['p90']} s, "
                f"step p50 {c['step_s']['p50']} s")
    finally:
        if server is not None:
            server.stop()
    return {**header(), "benchmark": "serve", "model": model if server else stats.get("model", {}).get("model"),
            "server_args": server_args if server else None, "clients": counts, "duration_s": duration,
            "max_tokens": max_tokens, "mix": {"long_share": LONG_SHARE, "leave_share": LEAVE_SHARE,
                                               "leave_after_chunks": LEAVE_AFTER, "seed": SEED},
            "loadavg_1min": load, "cells": cells, "checks": checks(cells),
            "engine": {"kernels": stats.get("kernels"), "speed": stats.get("speed")}}
