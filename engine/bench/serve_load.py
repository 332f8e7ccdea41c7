"""`tandem bench serve`: a bounded load test of `tandem serve` on loopback.

N clients stream chat completions back to back for a fixed time (each starts its next request as
its last one ends; no new request starts after the deadline, the ones in flight finish). Per request:
time to first token (request sent → first text chunk, as the client sees it), total latency,
completion tokens, errors by status. The server is started here on a free loopback port (or
`--url` points at a running one) and its own counters (/v1/tandem/stats) are recorded beside.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

from engine.bench.common import header

PROMPTS = ["Tell me a short story about a lighthouse.", "What is the capital of France?",
           "List three uses of copper.", "Explain what a prime number is.", "Write a haiku about rain.",
           "Why is the sky blue?", "Give me a tip for learning to cook.", "Describe a cat in one sentence."]


def add_arguments(p) -> None:
    p.add_argument("--model", default="builtin:smollm2-135m", help="what `tandem serve` loads")
    p.add_argument("--url", default=None, help="load an already running server instead (its /v1 address)")
    p.add_argument("--api-key", default=None, help="with --url: its key (default: $TANDEM_API_KEY)")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("--duration", type=float, default=30.0, help="seconds during which requests are started")
    p.add_argument("--max-tokens", type=int, default=32, help="reply length per request (EOS ignored)")
    p.add_argument("--server-args", default="--device cpu --cpu-threads 2 --max-batch 4",
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


async def _client(http, url: str, index: int, deadline: float, max_tokens: int, out: list[dict]) -> None:
    n = 0
    while time.monotonic() < deadline:
        prompt = PROMPTS[(index + n) % len(PROMPTS)]
        n += 1
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0.7, "stream_options": {"include_usage": True}}
        rec = {"client": index, "ok": False, "ttft_s": None, "status": None, "tokens": 0}
        t0 = time.monotonic()
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
                            if ch.get("delta", {}).get("content") and rec["ttft_s"] is None:
                                rec["ttft_s"] = time.monotonic() - t0
                    rec["ok"] = "error" not in rec and rec["tokens"] > 0
        except Exception as e:  # noqa: BLE001 — a failed request is a result of a load test
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["latency_s"] = time.monotonic() - t0
        rec["t_end"] = time.monotonic()
        out.append(rec)


async def _load(url: str, key: str, clients: int, duration: float, max_tokens: int) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, limits=limits,
                                 timeout=httpx.Timeout(10.0, read=600.0)) as http:
        out: list[dict] = []
        t0 = time.monotonic()
        await asyncio.gather(*(_client(http, url, i, t0 + duration, max_tokens, out) for i in range(clients)))
        return out, time.monotonic() - t0


def run(model: str, url: str | None, api_key: str | None, clients: int, duration: float, max_tokens: int,
        server_args: str, log=print) -> dict:
    import os
    import shlex

    import httpx

    from engine.server import launch

    server = None
    if url is None:
        log(f"[bench] starting tandem serve --model {model} {server_args}")
        server = launch.start_tandem(model, shlex.split(server_args) + ["--quiet", "--rate-limit", "0"])
        url, key = server.url, server.api_key
    else:
        key = api_key or os.environ.get("TANDEM_API_KEY") or ""
    try:
        headers = {"Authorization": f"Bearer {key}"}
        # one request first, so loading and first-call costs are not in the measurement
        httpx.post(url + "/chat/completions", headers=headers, timeout=120,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        before = httpx.get(url + "/tandem/stats", headers=headers, timeout=30).json().get("server", {})
        log(f"[bench] {clients} streaming clients for {duration:.0f} s, {max_tokens} tokens per reply")
        load_before = os.getloadavg()  # a shared machine: how busy it was is part of the result
        recs, wall = asyncio.run(_load(url, key, clients, duration, max_tokens))
        load_after = os.getloadavg()
        stats = httpx.get(url + "/tandem/stats", headers=headers, timeout=30).json()
    finally:
        if server is not None:
            server.stop()
    ok = [r for r in recs if r["ok"]]
    errors: dict[str, int] = {}
    for r in recs:
        if not r["ok"]:
            kind = str(r["status"]) if r["status"] and r["status"] != 200 else (r.get("error") or "?").split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
    tokens = sum(r["tokens"] for r in ok)
    after = stats.get("server", {})
    batches = (after.get("batches", 0) - before.get("batches", 0)) or None
    return {**header(), "benchmark": "serve", "model": model if server else stats.get("model", {}).get("model"),
            "server_args": server_args if server else None, "clients": clients, "duration_s": duration,
            "max_tokens": max_tokens, "wall_s": round(wall, 3),
            "loadavg_1min": {"before": round(load_before[0], 2), "after": round(load_after[0], 2)},
            "requests": len(recs), "completed": len(ok),
            "errors": errors, "error_count": len(recs) - len(ok),
            "requests_per_s": round(len(ok) / wall, 4), "completion_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 3), "ttft_s": summary([r["ttft_s"] for r in ok if r["ttft_s"]]),
            "latency_s": summary([r["latency_s"] for r in ok]),
            "server": {"batches": batches, "batch_size": after.get("batch_size"),
                       "mean_batch": round(len(ok) / batches, 3) if batches else None,
                       "rejected": after.get("rejected", 0) - before.get("rejected", 0),
                       "engine": {k: stats.get(k) for k in ("kernels",)} | {"speed": stats.get("speed")}}}
