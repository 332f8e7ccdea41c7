"""`tandem serve`: an OpenAI-compatible HTTP API over one Engine (FastAPI on uvicorn).

Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both streaming as
server-sent events when `stream` is true), GET /v1/tandem/stats (the engine's StatsSnapshot plus
the queue's counters under "server"), POST /tokenize (vLLM's shape: token ids of a prompt, or of a
chat under the model's template — what a remote client counts its context with), and GET /health
(no key: for waiting until the server is up).

Every route but /health needs `Authorization: Bearer <key>`. Every error is an OpenAI-style JSON body
(an unexpected one too: 500, its traceback in the server's log). A request is checked whole before
it is queued (limits.parse_json, schemas.py, token ids against the vocabulary), so a bad one is a
400 for its sender and never reaches a batch. A client that disconnects, streaming or not, cancels
its job at once (a task waits for the disconnect beside the reply), and the engine drops it at its
next step; each job also has a wall-clock limit (`time_limit_s`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, ValidationError

from engine.api import Engine, GenerationResult, Reasoning
from engine.errors import ConfigError, ContextOverflowError, TandemError
from engine.server.connections import ConnectionGuard
from engine.server.limits import APIError, BodySizeLimit, MiB, RateLimiter, parse_json
from engine.server.queue import EngineQueue, Job, QueueFullError
from engine.server.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("tandem.server")


@dataclass
class ServerSettings:
    api_key: str
    model_id: str
    max_request_bytes: int = 1 * MiB
    rate_limit_per_min: int = 600  # per client address; 0: off
    max_queue: int = 64  # waiting requests beyond this get 429
    default_max_tokens: int = 512  # when a request names none
    time_limit_s: float = 600.0  # wall clock per generation, from its start; 0: none
    header_timeout_s: float = 10.0  # request line + headers must arrive within this; 0: none
    body_timeout_s: float = 30.0  # the body may pause this long between pieces; then 408
    max_connections_per_address: int = 32  # open connections from one client address; 0: no cap


def served_model_id(model: str) -> str:
    """The id clients see: built-in and synthetic names as they are; a file or folder by its name only
    (the server does not tell clients where the user keeps files)."""
    if model.startswith(("builtin:", "synthetic:")):
        return model
    return Path(model).name


def finish_reason(result: GenerationResult) -> str:
    return "length" if result.finish_reason in ("length", "context_full", "time_limit") else "stop"


def usage(result: GenerationResult) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def error_from(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(429, f"{e.what} — {e.remedy}", "rate_limit_error", "queue_full")
    if isinstance(e, ContextOverflowError):
        return APIError(400, f"{e.what} — {e.remedy}", code="context_length_exceeded", param="messages")
    if isinstance(e, ConfigError):
        return APIError(400, f"{e.what} — {e.remedy}" if e.remedy else e.what)
    if isinstance(e, TandemError):
        return APIError(500, f"{e.what} — {e.remedy}" if e.remedy else e.what, "server_error")
    return APIError(500, f"internal error: {type(e).__name__}: {e} (the server's log holds the traceback)",
                    "server_error")


def vocabulary_size(engine: Engine) -> int | None:
    size = engine.info().get("vocab_size")
    if size is None and engine.tokenizer is not None:
        size = len(engine.tokenizer)
    return size


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    queue = EngineQueue(engine, max_pending=settings.max_queue, time_limit_s=settings.time_limit_s)
    limiter = RateLimiter(settings.rate_limit_per_min)
    vocab = vocabulary_size(engine)
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.queue, app.state.engine, app.state.settings = queue, engine, settings
    app.state.guard = ConnectionGuard(settings.header_timeout_s, settings.max_connections_per_address)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes, body_timeout_s=settings.body_timeout_s)
    key = settings.api_key.encode()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return JSONResponse(error_from(e).body(), status_code=500)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError):
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(404)
    async def not_found(request: Request, _e):
        return JSONResponse(APIError(404, f"no route {request.method} {request.url.path}", code="not_found").body(),
                            status_code=404)

    @app.exception_handler(405)
    async def bad_method(request: Request, _e):
        return JSONResponse(APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                     code="method_not_allowed").body(), status_code=405)

    async def guard(request: Request) -> None:
        """The key, and the rate limit: requests with a wrong key fill a bucket of their own (per
        address), so guessing keys is slow while the real key's requests are not held up by it."""
        auth = request.headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key)
        host = request.client.host if request.client else "?"
        wait = limiter.check(f"{host} {'key' if ok else 'no-key'}")
        if wait is not None:
            raise APIError(429, f"rate limit of {settings.rate_limit_per_min} requests a minute reached; "
                                f"retry in {wait:.1f} s", "rate_limit_error", "rate_limit_exceeded")
        if not ok:
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           "invalid_request_error", "invalid_api_key")

    async def parse(request: Request, model: type[BaseModel]):
        data = parse_json(await request.body())
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"])
            raise APIError(400, f"{param}: {first['msg']}", param=param, code="invalid_value") from None
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        ids = body.token_ids() if hasattr(body, "token_ids") else None
        if ids and vocab is not None and not 0 <= min(ids) <= max(ids) < vocab:
            worst = min(ids) if min(ids) < 0 else max(ids)
            raise APIError(400, f"prompt: token id {worst} is outside the vocabulary (0 … {vocab - 1})",
                           param="prompt", code="invalid_value")
        if body.model not in (None, "", settings.model_id, engine.config.model):
            raise APIError(404, f"model '{body.model}' is not served here; this server has '{settings.model_id}'",
                           param="model", code="model_not_found")
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": settings.model_id}

    @app.get("/v1/models", dependencies=[Depends(guard)])
    async def models():
        return {"object": "list", "data": [{"id": settings.model_id, "object": "model", "created": 0,
                                            "owned_by": "tandem", "max_context": engine.max_context}]}

    @app.get("/v1/tandem/stats", dependencies=[Depends(guard)])
    async def stats():
        for attempt in range(3):  # the engine counts; reading never waits for a generation…
            try:
                snap = engine.stats().to_dict()
                break
            except RuntimeError:  # …but a sequence added or freed mid-read changes what it iterates
                if attempt == 2:
                    raise
                await asyncio.sleep(0.01)
        snap["server"] = queue.stats() | {"connections": app.state.guard.stats()}
        return snap

    @app.post("/tokenize", dependencies=[Depends(guard)])
    async def tokenize(request: Request):
        data = await parse(request, TokenizeRequest)
        what = [m.model_dump() for m in data.messages] if data.messages is not None else data.prompt
        try:
            ids = await asyncio.wrap_future(queue.call(
                lambda eng: eng.render(what) if isinstance(what, list) else eng.tokenize(what)))
        except TandemError as e:
            raise error_from(e) from None
        except Exception as e:  # noqa: BLE001 — the tokenizer's own failure: logged, answered as JSON
            log.error("tokenize failed", exc_info=e)
            raise error_from(e) from None
        return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids}

    @app.post("/v1/chat/completions", dependencies=[Depends(guard)])
    async def chat_completions(request: Request):
        body = await parse(request, ChatCompletionRequest)
        return await respond(request, body, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(guard)])
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        return await respond(request, body, chat=False)

    async def respond(request: Request, body, chat: bool):
        try:
            job = queue.submit(body.to_generation(settings.default_max_tokens))
        except TandemError as e:
            raise error_from(e) from None
        watcher = asyncio.create_task(cancel_on_disconnect(request, job))
        try:
            # The first event decides the status: an error before any text is a proper HTTP error.
            first = await next_event(job)
            if first is None:
                return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
            if first[0] == "error":
                raise error_from(first[1])
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            shape = ChunkShape(rid, int(time.time()), settings.model_id, chat)
            if body.stream:  # from here the response watches for the disconnect itself (sse's finally)
                return StreamingResponse(sse(job, first, shape, body.include_usage),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            event = first
            while event[0] == "text":
                event = await next_event(job)
                if event is None:
                    return JSONResponse({}, status_code=499)
            if event[0] == "error":
                raise error_from(event[1])
            return shape.whole(event[1])
        finally:
            watcher.cancel()

    return app


class TokenizeMessage(BaseModel):
    role: str
    content: str


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize shape: a raw `prompt`, or `messages` rendered under the chat template
    (ending with the assistant's turn, as a generation would see them)."""

    prompt: str | None = None
    messages: list[TokenizeMessage] | None = Field(None, min_length=1)  # the template refuses an empty chat
    model: str | None = None

    def unsupported(self):
        if (self.prompt is None) == (self.messages is None):
            return "prompt", "give exactly one of prompt or messages"
        return None


async def cancel_on_disconnect(request: Request, job: Job) -> None:
    """Wait for the client's disconnect (the body is read already: the next message is the
    disconnect), then cancel the job — the engine drops it at its next step — and wake the reader."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            job.events.put_nowait(("gone", None))
            return


async def next_event(job: Job):
    """The job's next event; None when the client has gone."""
    event = await job.events.get()
    return None if event[0] == "gone" else event


@dataclass
class ChunkShape:
    """The JSON shapes of one response, chat or text completion."""

    id: str
    created: int
    model: str
    chat: bool

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> dict:
        if self.chat:
            # a reasoning model's reasoning streams beside the answer, as reasoning_content (DeepSeek's, vLLM's name)
            field = "reasoning_content" if isinstance(text, Reasoning) else "content"
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {field: str(text)})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, result: GenerationResult) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": usage(result)}

    def whole(self, result: GenerationResult) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": result.text}
            if result.reasoning:
                message["reasoning_content"] = result.reasoning
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": finish_reason(result)}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage(result)}
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish_reason(result)}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(result)}


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def sse(job: Job, first, shape: ChunkShape, include_usage: bool):
    """Server-sent events: a role chunk (chat), text chunks, a finish chunk, usage if asked, [DONE]."""
    finished = False
    try:
        if shape.chat:
            yield _data(shape.chunk(None, role=True))
        event = first
        while event is not None:
            kind, value = event
            if kind == "text":
                yield _data(shape.chunk(value))
            elif kind == "error":
                yield _data(error_from(value).body())
                break
            else:
                yield _data(shape.chunk(None if shape.chat else "", finish_reason(value)))
                if include_usage:
                    yield _data(shape.usage_chunk(value))
                break
            event = await next_event(job)
        finished = event is not None
        if finished:
            yield "data: [DONE]\n\n"
    finally:
        if not finished:  # cancelled (the client went away) or closed early: stop the engine's work for it
            job.cancel()


def serve(engine: Engine, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "warning", ready=None) -> None:
    """Run the server until interrupted (Ctrl-C / SIGTERM), then stop the engine's work and return.
    ready(server, requests at once): called once it listens."""
    import uvicorn

    tandem_log = logging.getLogger("tandem")
    if not tandem_log.handlers and not logging.getLogger().handlers:  # failures go to stderr, tracebacks and all
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        tandem_log.addHandler(handler)
    app = create_app(engine, settings)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5, http=app.state.guard.protocol())
    server = uvicorn.Server(config)
    if ready is not None:
        original = server.startup

        async def startup(sockets=None):
            await original(sockets)
            if server.started:
                ready(server, app.state.queue.batch_size)

        server.startup = startup
    try:
        server.run()
    finally:
        app.state.queue.close()
