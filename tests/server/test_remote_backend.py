"""Tandem's remote backend (Engine over an OpenAI-compatible endpoint) against real servers:
`tandem serve`, and llama-cpp-python's own server on the same built-in GGUF."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from engine.api import Engine, EngineConfig, GenerationRequest
from engine.errors import ConfigError, ContextOverflowError

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def remote(server, **kw) -> Engine:
    return Engine(EngineConfig(backend="remote", remote_url=server.url, remote_api_key=server.api_key, **kw))


def test_generate_through_tandem_serve(tandem_server):
    engine = remote(tandem_server)  # the default model name: the server's own model is chosen
    try:
        assert engine.info()["model"] == "builtin:smollm2-135m" and engine.info()["backend"] == "remote"
        pieces = []
        result = engine.generate(GenerationRequest(messages=QUESTION, greedy=True, max_new_tokens=16),
                                 on_text=pieces.append)
        direct = httpx.post(tandem_server.url + "/chat/completions", json={"messages": QUESTION, "temperature": 0,
                            "max_tokens": 16}, headers={"Authorization": f"Bearer {tandem_server.api_key}"}).json()
        assert result.text == "".join(pieces) == direct["choices"][0]["message"]["content"]
        assert "Paris" in result.text
        assert result.prompt_tokens == direct["usage"]["prompt_tokens"]
        assert result.completion_tokens == direct["usage"]["completion_tokens"]
        assert result.ttft_s is not None and 0 < result.ttft_s < 30
        # counting: the server's template, exactly what a generation is charged
        assert len(engine.render(QUESTION)) == result.prompt_tokens
        assert engine.info()["token_counts"] == "exact" and engine.info()["context_source"] == "server"
        snap = engine.stats().to_dict()
        assert snap["model"]["backend"] == "remote" and snap["model"]["remote"] is True
        assert snap["speed"]["measured"] == "client" and snap["speed"]["ttft_s"] == result.ttft_s
        assert snap["speed"]["decode_tok_s"] is not None and snap["speed"]["decode_tok_s"] > 0
        assert snap["vram"]["weights"] is None and snap["experts"]["hit_rate"] is None  # the server's, not ours
        assert snap["phase"] == "idle"
    finally:
        engine.close()


def test_raw_prompt_and_stop_strings(tandem_server):
    engine = remote(tandem_server, model="builtin:smollm2-135m")
    try:
        r = engine.generate(GenerationRequest(prompt="1, 2, 3, 4,", raw=True, greedy=True, max_new_tokens=12,
                                              stop=["7"]))
        assert r.finish_reason == "stop" and "7" not in r.text and "6" in r.text
        r = engine.generate(GenerationRequest(prompt="1, 2, 3,", raw=True, greedy=True, max_new_tokens=5))
        assert r.finish_reason == "length" and r.completion_tokens == 5
    finally:
        engine.close()


def test_stop_event_ends_the_remote_generation(tandem_server):
    engine = remote(tandem_server)
    stop = threading.Event()
    seen = []

    def on_text(text):
        seen.append(text)
        if len(seen) == 3:
            stop.set()

    try:
        r = engine.generate(GenerationRequest(prompt="Once upon a time", raw=True, max_new_tokens=1500,
                                              ignore_eos=True), on_text=on_text, stop_event=stop)
    finally:
        engine.close()
    assert r.finish_reason == "stopped" and len(seen) == 3
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the server notices the closed connection at its next token
        stats = httpx.get(tandem_server.url + "/tandem/stats",
                          headers={"Authorization": f"Bearer {tandem_server.api_key}"}).json()["server"]
        if stats["cancelled"] >= 1 and stats["running"] == 0:
            break
        time.sleep(0.2)
    cancelled = [j for j in stats["recent"] if j["outcome"] == "cancelled"]
    assert cancelled and cancelled[-1]["completion_tokens"] < 400


def test_errors_from_the_server(tandem_server):
    with pytest.raises(ConfigError, match="refused the API key"):
        Engine(EngineConfig(backend="remote", remote_url=tandem_server.url, remote_api_key="wrong"))
    with pytest.raises(ConfigError, match="does not serve"):
        remote(tandem_server, model="gpt-4o")
    engine = remote(tandem_server)
    try:
        with pytest.raises(ContextOverflowError):
            engine.generate(GenerationRequest(prompt="word " * (engine.max_context + 10), raw=True))
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="cannot reach"):
        Engine(EngineConfig(backend="remote", remote_url="http://127.0.0.1:9/v1", remote_api_key="k"))


def test_generate_through_llama_cpp_server(llamacpp_server):
    engine = remote(llamacpp_server)
    try:
        assert engine.info()["model"] == "smollm2-135m"
        pieces = []
        r = engine.generate(GenerationRequest(messages=QUESTION, greedy=True, max_new_tokens=24), on_text=pieces.append)
        assert r.text.strip() and r.text == "".join(pieces)
        assert r.completion_tokens > 0 and r.ttft_s is not None
        snap = engine.stats().to_dict()
        assert snap["speed"]["ttft_s"] == r.ttft_s and snap["model"]["backend"] == "remote"
        raw = engine.generate(GenerationRequest(prompt="1, 2, 3,", raw=True, greedy=True, max_new_tokens=6))
        assert raw.text.strip() and raw.finish_reason in ("length", "stop")
        ids = engine.tokenize("Hello world")
        assert 1 <= len(ids) <= 4 and engine.info()["token_counts"] == "approximate"
    finally:
        engine.close()


def test_llama_cpp_server_refuses_a_bad_key(llamacpp_server):
    with pytest.raises(ConfigError, match="refused the API key"):
        Engine(EngineConfig(backend="remote", remote_url=llamacpp_server.root, remote_api_key="wrong"))
