"""What keeps a local server safe to leave running: OpenAI-style errors, a request-size cap
(checked before the body is parsed) and a per-client rate limit (a token bucket)."""

from __future__ import annotations

import json
import threading
import time

MiB = 2**20


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before anything parses it — at once
    when Content-Length says so, else as soon as the streamed body passes the limit."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

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
            message = await receive()
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
        err = APIError(413, f"the request body is larger than {self.max_bytes} bytes", code="request_too_large")
        payload = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
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
