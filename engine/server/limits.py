"""What keeps a local server safe to leave running: OpenAI-style errors, a request-size cap and a
body-read timeout (checked before the body is parsed), limits on the JSON's shape (nesting depth,
number length: checked before parsing, where Python's parser would recurse or spend quadratic time),
and a per-client rate limit (a token bucket)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import numpy as np

MiB = 2**20
MAX_JSON_DEPTH = 32  # nested arrays/objects; a chat request needs 5
MAX_NUMBER_CHARS = 40  # a number token longer than this is refused (a 2^64 seed has 20 digits)


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)  # a JSON string, escapes and all
_LONG_NUMBER = re.compile(rb"[-+0-9.eE]{%d,}" % (MAX_NUMBER_CHARS + 1))
_BRACKET_STEP = np.zeros(256, dtype=np.int32)
_BRACKET_STEP[list(b"[{")] = 1
_BRACKET_STEP[list(b"]}")] = -1


def json_shape_problem(raw: bytes) -> str | None:
    """Why this body's JSON is refused before it is parsed, or None: nesting deeper than
    MAX_JSON_DEPTH (100,000 brackets make json.loads raise RecursionError), or a number longer than
    MAX_NUMBER_CHARS (int() of 5,000 digits raises, and takes quadratic time below that limit).
    Strings are blanked first, so brackets and digits inside them do not count. Linear time: regexes
    and a numpy prefix sum, no Python loop over the bytes."""
    bare = _STRING.sub(b'""', raw)
    long = _LONG_NUMBER.search(bare)
    if long is not None:
        return f"a number of {len(long.group())} characters (at most {MAX_NUMBER_CHARS})"
    steps = _BRACKET_STEP[np.frombuffer(bare, dtype=np.uint8)]
    if steps.any() and int(np.cumsum(steps).max()) > MAX_JSON_DEPTH:
        return f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
    return None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json(raw: bytes):
    """The body as JSON, or an APIError: shape limits first, then strict JSON (no NaN or Infinity),
    then no lone surrogates anywhere (\\ud800 parses, but no tokenizer can encode it)."""
    problem = json_shape_problem(raw)
    if problem is not None:
        raise APIError(400, f"the request body is refused: {problem}", code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request holds a lone surrogate (an unpaired \\ud800-\\udfff escape): "
                            "send valid Unicode text", code="invalid_value") from None
    return data


def error_response(status: int, message: str, code: str) -> tuple[list, bytes]:
    """Headers and body of an OpenAI-style error that closes the connection."""
    payload = json.dumps(APIError(status, message, code=code).body()).encode()
    return [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close")], payload


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before anything parses it — at once
    when Content-Length says so, else as soon as the streamed body passes the limit. A body that
    stops arriving (shorter than its Content-Length, or a client that went silent) gets 408 after
    `body_timeout_s` without a byte."""

    def __init__(self, app, max_bytes: int, body_timeout_s: float = 30.0):
        self.app, self.max_bytes, self.body_timeout_s = app, max_bytes, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:  # read the whole (bounded) body, then replay it to the app
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:
                return await self._send(send, 408, f"the request body stopped arriving ({size} bytes in "
                                                   f"{self.body_timeout_s:g} s without more)", "request_timeout")
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._reject(send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would report it

        await self.app(scope, replay, send)

    async def _reject(self, send):
        await self._send(send, 413, f"the request body is larger than {self.max_bytes} bytes", "request_too_large")

    @staticmethod
    async def _send(send, status: int, message: str, code: str):
        headers, payload = error_response(status, message, code)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


class RateLimiter:
    """A token bucket per client: `per_minute` requests a minute on average, bursts of up to
    `per_minute` at once. 0 turns it off."""

    def __init__(self, per_minute: int):
        self.per_minute = per_minute
        self._buckets: dict[str, tuple[float, float]] = {}  # client → (tokens, last refill time)
        self._lock = threading.Lock()

    def check(self, client: str) -> float | None:
        """Take one token for `client`; None when allowed, else seconds until the next token."""
        if self.per_minute <= 0:
            return None
        rate = self.per_minute / 60.0  # tokens per second
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(client, (float(self.per_minute), now))
            tokens = min(float(self.per_minute), tokens + (now - last) * rate)
            if tokens < 1.0:
                self._buckets[client] = (tokens, now)
                return (1.0 - tokens) / rate
            self._buckets[client] = (tokens - 1.0, now)
            return None
