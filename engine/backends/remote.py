"""Any OpenAI-compatible server (another `tandem serve`, llama.cpp's server, vLLM, …) behind
Tandem's Engine interface: for users whose model has outgrown one machine.

Chats go to /v1/chat/completions, raw prompts to /v1/completions, always streamed (SSE), so the
reply shows as it arrives and a stop closes the connection (the server then stops generating).
Speed is measured here, on the client: time to first token from sending the request to the first
text, decode tokens/s over the rest; the stats say `"backend": "remote"` so the panels can say
that the numbers include the network and that memory, KV and experts are the server's.

Token counts for the context gauge come from the server when it can tokenise: `/tokenize` (Tandem
and vLLM: the chat under the model's template, exact) or llama.cpp's `/extras/tokenize` (the
messages' text without the template: a close count, marked approximate in info()). A server with
neither cannot count, and tokenize() says so. The server returns text, not token ids, so results
carry no token_ids.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Callable

import psutil

from engine.errors import ConfigError, ContextOverflowError, TandemError
from engine.models.builtin import DEFAULT_MODEL
from engine.runtime.harmony import Reasoning
from engine.runtime.requests import GenerationRequest, GenerationResult
from engine.runtime.telemetry import GenerationTimer, StatsSnapshot

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 300.0  # the longest wait for the next chunk (a long prompt's prefill on a slow server)
ASSUMED_CONTEXT = 4096  # when neither the server nor the config says


def api_base(url: str) -> tuple[str, str]:
    """(root, OpenAI base) of a server address given with or without its /v1."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"'{url}' is not an http(s) address", "give the server's URL, e.g. http://127.0.0.1:8000/v1")
    root = url[:-3] if url.endswith("/v1") else url
    return root, root + "/v1"


class RemoteBackend:
    name = "remote"

    def __init__(self, config, progress: Callable[[str, float], None] | None = None):
        import httpx

        report = progress or (lambda step, frac: None)
        if not config.remote_url:
            raise ConfigError("the remote backend needs the server's address", "set remote_url (--remote-url URL)")
        self.config = config
        self.root, self.base = api_base(config.remote_url)
        headers = {"Authorization": f"Bearer {config.remote_api_key}"} if config.remote_api_key else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S))
        self.tokenizer = None  # tokenising happens on the server
        self.phase = "idle"
        self.last: GenerationTimer | None = None
        self.requests_sent = 0
        self._counter: str | None = None  # which tokenise route the server has (found on first use)
        self._lock = threading.Lock()
        report(f"asking {self.base} for its models", 0.2)
        listed = self._get_json("/models").get("data") or []
        ids = [m.get("id") for m in listed if m.get("id")]
        if not ids:
            raise ConfigError(f"{self.base} serves no models", "check the server")
        wanted = config.model
        if wanted in ids:
            self.model = wanted
        elif wanted in (None, "", "auto", DEFAULT_MODEL):  # nothing chosen for this server: its first model
            self.model = ids[0]
        else:
            raise ConfigError(f"{self.base} does not serve '{wanted}'", f"choose one of: {', '.join(ids)}")
        entry = next(m for m in listed if m.get("id") == self.model)
        served = entry.get("max_context") or entry.get("max_model_len")
        self.context_source = "server" if served else ("config" if config.max_context else "assumed")
        self.max_context = int(config.max_context or served or ASSUMED_CONTEXT)
        report("ready", 1.0)

    # -- HTTP -------------------------------------------------------------------------------------
    def _url(self, path: str) -> str:
        return (self.root if path.startswith("/tokenize") or path.startswith("/extras") else self.base) + path

    def _fail(self, response) -> TandemError:
        try:
            err = response.json().get("error") or {}
            message = err.get("message") if isinstance(err, dict) else str(err)
            code = err.get("code") if isinstance(err, dict) else None
        except (ValueError, AttributeError):
            message, code = response.text[:300], None
        message = message or response.text[:300] or response.reason_phrase
        if response.status_code == 401:
            return ConfigError(f"{self.base} refused the API key ({message})", "check the key in Settings")
        if code == "context_length_exceeded" or "context" in (message or "").lower() and response.status_code == 400:
            return ContextOverflowError(f"the server says: {message}", "shorten the prompt or the history")
        if response.status_code in (400, 404, 422):
            return ConfigError(f"the server refused the request ({response.status_code}: {message})",
                               "check the model and settings")
        return TandemError(f"the server answered {response.status_code}: {message}", "try again; check the server")

    def _unreachable(self, e) -> ConfigError:
        return ConfigError(f"cannot reach {self.base} ({type(e).__name__}: {e})",
                           "check the address and that the server is running")

    def _get_json(self, path: str) -> dict:
        import httpx

        try:
            r = self.http.get(self._url(path))
        except httpx.HTTPError as e:
            raise self._unreachable(e) from e
        if r.status_code != 200:
            raise self._fail(r)
        return r.json()

    def _post_json(self, path: str, body: dict):
        import httpx

        try:
            return self.http.post(self._url(path), json=body)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from e

    # -- tokens -----------------------------------------------------------------------------------
    def info(self) -> dict:
        return {"backend": self.name, "model": self.model, "family": "remote", "layers": None, "experts": None,
                "top_k": None, "device": "remote", "dtype": None, "max_context": self.max_context,
                "kv_policy": None, "expert_policy": None, "remote_url": self.base,
                "context_source": self.context_source, "token_counts": self._count_kind()}

    def _count_kind(self) -> str | None:
        return {"tokenize": "exact", "extras": "approximate", "none": "unavailable"}.get(self._counter or "")

    def _count(self, text: str | None, messages: list[dict] | None) -> list[int]:
        with self._lock:
            if self._counter in (None, "tokenize"):
                body = {"model": self.model, **({"messages": messages} if messages is not None else {"prompt": text})}
                r = self._post_json("/tokenize", body)
                if r.status_code == 200:
                    self._counter = "tokenize"
                    return list(r.json()["tokens"])
                if self._counter == "tokenize" or r.status_code not in (404, 405):
                    raise self._fail(r)
            if self._counter in (None, "extras"):
                flat = text if messages is None else "".join(f"{m['role']}: {m['content']}\n" for m in messages)
                r = self._post_json("/extras/tokenize", {"input": flat, "model": self.model})
                if r.status_code == 200:
                    self._counter = "extras"
                    return list(r.json()["tokens"])
                if self._counter == "extras" or r.status_code not in (404, 405):
                    raise self._fail(r)
            self._counter = "none"
        raise ConfigError(f"{self.base} cannot tokenise, so prompts cannot be counted here",
                          "the server counts them itself; use a Tandem, vLLM or llama.cpp server for a live count")

    def tokenize(self, text: str) -> list[int]:
        return self._count(text, None)

    def render(self, messages: list[dict]) -> list[int]:
        return self._count(None, [{"role": m["role"], "content": m["content"]} for m in messages])

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        if req.messages is not None:
            return self.render(req.messages)
        return self.tokenize(req.prompt) if req.raw else self.render([{"role": "user", "content": req.prompt or ""}])

    # -- generation -------------------------------------------------------------------------------
    def _body(self, req: GenerationRequest) -> tuple[str, dict]:
        p = req.sampling()
        p.validate()
        body = {"model": self.model, "max_tokens": req.max_new_tokens, "stream": True,
                "stream_options": {"include_usage": True},
                "temperature": 0.0 if p.greedy or p.temperature == 0 else p.temperature}
        if not p.greedy:
            body["top_p"] = p.top_p
            if p.top_k:
                body["top_k"] = p.top_k  # an extension llama.cpp, vLLM and Tandem accept
        if p.repetition_penalty != 1.0:
            body["repetition_penalty"] = body["repeat_penalty"] = p.repetition_penalty  # vLLM's name, llama.cpp's
        if p.seed is not None:
            body["seed"] = p.seed
        if req.stop:
            body["stop"] = list(req.stop)
        if req.ignore_eos:
            body["ignore_eos"] = True
        if req.messages is not None or (req.prompt is not None and not req.raw):
            msgs = req.messages if req.messages is not None else [{"role": "user", "content": req.prompt}]
            body["messages"] = [{"role": m["role"], "content": m["content"]} for m in msgs]
            return "/chat/completions", body
        if req.prompt_ids is not None:
            body["prompt"] = list(req.prompt_ids)
        elif req.prompt is not None:
            body["prompt"] = req.prompt
        else:
            raise ConfigError("the request has no prompt", "give messages, prompt or prompt_ids")
        return "/completions", body

    def generate_batch(self, requests, on_text, stop_event) -> list[GenerationResult]:
        # One stream at a time, as the Engine's callers expect; the server queues or batches its own.
        return [self._generate(i, r, on_text, stop_event) for i, r in enumerate(requests)]

    def _generate(self, index: int, req: GenerationRequest, on_text, stop_event) -> GenerationResult:
        import httpx

        path, body = self._body(req)
        timer = GenerationTimer()
        self.last = timer
        self.requests_sent += 1
        pieces, finish, usage, chunks = [], None, None, 0
        t_first = t_last = None
        if stop_event is not None and stop_event.is_set():
            return self._result("", "stopped", usage, chunks, timer)
        self.phase = "prefill"
        try:
            with self.http.stream("POST", self._url(path), json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise self._fail(response)
                for line in response.iter_lines():
                    if stop_event is not None and stop_event.is_set():
                        finish = "stopped"  # leaving the block closes the connection: the server stops
                        break
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        err = event["error"]
                        raise TandemError(f"the server failed mid-reply: {err.get('message', err)}",
                                          "try again; check the server")
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        delta = choice.get("delta") or {}
                        text = delta.get("content") if "delta" in choice else choice.get("text")
                        if delta.get("reasoning_content"):  # a reasoning model's thinking, apart from its answer
                            text = Reasoning(delta["reasoning_content"])
                        if text:
                            now = time.perf_counter()
                            if t_first is None:
                                t_first = now
                                timer.ttft_s = now - timer.t_start
                                self.phase = "decode"
                            t_last = now
                            chunks += 1
                            pieces.append(text)
                            if on_text:
                                on_text(index, text)
                        finish = choice.get("finish_reason") or finish
        except httpx.HTTPError as e:
            raise self._unreachable(e) from e
        finally:
            self.phase = "idle"
        if t_first is not None:
            generated = (usage or {}).get("completion_tokens") or chunks
            timer.prefill_tokens = (usage or {}).get("prompt_tokens") or 0
            timer.prefill_s = timer.ttft_s  # network included: what this machine waited
            timer.decode_tokens, timer.decode_s = max(generated - 1, 0), t_last - t_first
        answer = "".join(p for p in pieces if not isinstance(p, Reasoning))
        return self._result(answer, finish, usage, chunks, timer,
                            reasoning="".join(p for p in pieces if isinstance(p, Reasoning)))

    def _result(self, text: str, finish: str | None, usage: dict | None, chunks: int,
                timer: GenerationTimer, reasoning: str = "") -> GenerationResult:
        usage = usage or {}
        reason = {"stop": "stop", "length": "length", "stopped": "stopped"}.get(finish or "", "stop")
        return GenerationResult(text=text, token_ids=[], finish_reason=reason,
                                prompt_tokens=usage.get("prompt_tokens") or 0,
                                prefilled_tokens=usage.get("prompt_tokens") or 0,
                                completion_tokens=usage.get("completion_tokens") or chunks, ttft_s=timer.ttft_s,
                                prefill_tok_s=timer.prefill_tok_s, decode_tok_s=timer.decode_tok_s,
                                reasoning=reasoning)

    def end_session(self, session_id: str) -> None:
        pass  # the server keeps no per-chat state for this client

    def stats(self) -> StatsSnapshot:
        """What this machine can see of a remote model: the phase and the speed measured here. Memory,
        KV and experts live on the server: null (not applicable here), never 0."""
        t = self.last
        nulls = lambda *keys: dict.fromkeys(keys)  # noqa: E731
        return StatsSnapshot(
            phase=self.phase,
            vram=nulls("weights", "expert_cache", "kv_dwindow", "kv_pingpong", "kv_resident", "workspace", "budget",
                       "device_total", "device_used"),
            host={**nulls("kv_pinned", "kv_unpinned", "expert_store"), "rss": psutil.Process().memory_info().rss},
            kv={"policy": None, "tokens": nulls("dwindow", "pinned", "unpinned", "resident"),
                **nulls("r_target", "r_deployed", "A_ns_per_token", "B_ns_per_token", "delta_ms")},
            experts=nulls("policy", "hits", "misses", "fills", "cpu_executed", "evictions", "prefetch_used",
                          "prefetch_wasted", "hit_rate", "prefetch_issued", "slots", "cpu_expert_s", "predictor"),
            pcie=nulls("h2d_bytes", "d2h_bytes", "h2d_gbps", "d2h_gbps"),
            speed={"prefill_tok_s": t and t.prefill_tok_s, "decode_tok_s": t and t.decode_tok_s,
                   "ttft_s": t and t.ttft_s, "measured": "client"},
            kernels={"cpu_attention": None, "cpu_experts": None}, profile=None,
            model={**self.info(), "remote": True, "requests_sent": self.requests_sent})

    def close(self) -> None:
        self.http.close()
