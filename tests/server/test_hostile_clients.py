"""`tandem serve` under hostile and busy clients: a bad request is a 400 for its sender only, the
JSON parser's limits hold before parsing, unhonoured parameters are refused, sockets that stall are
closed, a client that leaves (streaming or not) stops its generation at once, and a request joins a
running batch instead of waiting for it."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from strict_limits import STRICT
from test_serve_api import QUESTION, assert_openai_error, client


def post_together(server, bodies: list[tuple[str, dict]]) -> list[httpx.Response]:
    """Send the requests at once (so the good ones share a batch with the bad), → their responses."""
    out: list = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def one(i, path, body):
        with client(server) as c:
            barrier.wait()
            out[i] = c.post(path, json=body)

    threads = [threading.Thread(target=one, args=(i, p, b)) for i, (p, b) in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_a_bad_request_fails_only_its_sender(tandem_server):
    good = {"prompt": "1, 2, 3, 4,", "temperature": 0, "max_tokens": 24, "ignore_eos": True}
    bad = [{"prompt": [1, 2, 99999999], "max_tokens": 4}, {"prompt": [5, -3, 7], "max_tokens": 4},
           {"prompt": "Hi", "seed": 2**64, "max_tokens": 4}, {"prompt": "Hi", "seed": -2, "max_tokens": 4}]
    with client(tandem_server) as c:
        alone = c.post("/v1/completions", json=good).json()["choices"][0]["text"]
    responses = post_together(tandem_server, [("/v1/completions", good)] +
                              [("/v1/completions", b) for b in bad] + [("/v1/completions", good)])
    for r in (responses[0], responses[-1]):
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 24 and r.json()["choices"][0]["text"] == alone
    for r, param in zip(responses[1:-1], ("prompt", "prompt", "seed", "seed")):
        assert_openai_error(r, 400, "invalid_value")
        assert r.json()["error"]["param"] == param, r.json()
    with client(tandem_server) as c:  # the seed -1 of llama.cpp's server: a random seed, accepted
        assert c.post("/v1/completions", json={"prompt": "Hi", "seed": -1, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("raw", [
    b'{"prompt": "Hi", "max_tokens": 2, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"prompt": "Hi", "x": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"}",
    b'{"prompt": "Hi", "max_tokens": ' + b"7" * 5000 + b"}",
    b'{"prompt": "Hi", "temperature": NaN}',
    b'{"prompt": "\\ud800", "max_tokens": 2}',
], ids=["nested-arrays", "nested-objects", "5000-digits", "nan", "lone-surrogate"])
def test_json_limits_hold_before_parsing(tandem_server, raw):
    with client(tandem_server) as c:
        r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_openai_error(r, 400)
        assert r.headers["content-type"] == "application/json"


def test_lone_surrogates_are_refused_on_every_route(tandem_server):
    with client(tandem_server) as c:
        for path, raw in [("/tokenize", b'{"prompt": "a\\udfffb"}'),
                          ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
                          ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\ud83d"}]}')]:
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            assert_openai_error(r, 400, "invalid_value")
            assert "surrogate" in r.json()["error"]["message"]
        assert c.post("/tokenize", json={"prompt": "\U0001F600"}).json()["count"] >= 1  # a pair is fine


def test_sampling_edges_are_greedy_or_refused(tandem_server):
    """A temperature of 1e-38 used to overflow the tempered logits (NaN: the reply repeated the
    vocabulary's last token); below the stated minimum it is greedy. A penalty of 1e-300 is refused."""
    body = {"messages": QUESTION, "max_tokens": 8}
    with client(tandem_server) as c:
        greedy = c.post("/v1/chat/completions", json={**body, "temperature": 0}).json()
        tiny = c.post("/v1/chat/completions", json={**body, "temperature": 1e-38}).json()
        assert tiny["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
        assert "Paris" in tiny["choices"][0]["message"]["content"]
        for value in (1e-300, 0, 1e300):
            r = c.post("/v1/chat/completions", json={**body, "repetition_penalty": value})
            assert_openai_error(r, 400, "invalid_value")
            assert r.json()["error"]["param"] == "repetition_penalty"


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"logit_bias": {"50256": -100}}, "logit_bias"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
])
def test_parameters_that_cannot_be_honoured_are_refused(tandem_server, path, extra, param):
    body = {"messages": QUESTION} if "chat" in path else {"prompt": "Hi"}
    with client(tandem_server) as c:
        r = c.post(path, json={**body, "max_tokens": 2, **extra})
        assert_openai_error(r, 400, "unsupported_parameter")
        assert r.json()["error"]["param"] == param
        ok = c.post(path, json={**body, "max_tokens": 2, "response_format": {"type": "text"}, "tool_choice": "none"}
                    if "chat" in path else {**body, "max_tokens": 2, "best_of": 1})
        assert ok.status_code == 200, ok.text


def _connect(server) -> socket.socket:
    host, port = server.root.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes; → (bytes, seconds it took)."""
    t0, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {limit_s} s; got {data[:200]!r}") from None
    return data, time.monotonic() - t0


def test_silent_socket_is_closed_with_408(strict_server):
    with _connect(strict_server) as s:
        data, took = _read_until_closed(s, 10)
    assert data.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in data, data
    assert took < STRICT["header_timeout"] + 2


def test_headers_a_piece_at_a_time_are_cut_off(strict_server):
    with _connect(strict_server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        try:
            for i in range(40):  # one header every 0.25 s: each keeps the socket busy, none ends the headers
                s.sendall(f"X-Slow-{i}: y\r\n".encode())
                time.sleep(0.25)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, _ = _read_until_closed(s, 10)
    assert time.monotonic() - t0 < STRICT["header_timeout"] + 3
    assert data.startswith(b"HTTP/1.1 408"), data


def test_body_shorter_than_its_content_length_gets_408(strict_server):
    with _connect(strict_server) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + strict_server.api_key.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        data, took = _read_until_closed(s, 10)
    assert b" 408 " in data.split(b"\r\n", 1)[0] and b'"request_timeout"' in data, data
    assert took < STRICT["body_timeout"] + 3


def test_open_connections_per_address_are_capped(strict_server):
    socks = [_connect(strict_server) for _ in range(STRICT["max_connections"])]
    try:
        time.sleep(0.2)
        with _connect(strict_server) as extra:
            data, _ = _read_until_closed(extra, 5)
        assert data.startswith(b"HTTP/1.1 429") and b"too_many_connections" in data, data
    finally:
        for s in socks:
            s.close()
    time.sleep(0.3)
    with client(strict_server) as c:  # once they are closed, the address may connect again
        assert c.get("/v1/models").status_code == 200


def test_the_time_limit_ends_a_long_generation(strict_server):
    body = {"prompt": "Once upon a time", "max_tokens": 100_000, "ignore_eos": True}
    with client(strict_server) as c:
        t0 = time.monotonic()
        r = c.post("/v1/completions", json=body)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] > 0
        assert took < STRICT["time_limit"] + 5
        record = c.get("/v1/tandem/stats").json()["server"]["recent"][-1]
    assert record["outcome"] == "timed_out" and record["finish_reason"] == "time_limit"


def _wait_for(c: httpx.Client, what, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = c.get("/v1/tandem/stats").json()
        if what(s):
            return s
        time.sleep(0.05)
    raise AssertionError(f"not reached in {timeout_s} s: {s['server']}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_its_generation_at_once(tandem_server, stream):
    """A non-streaming client that disconnects used to be noticed only after 0.25 s without a token,
    which never happens while tokens flow: its generation ran to max_tokens."""
    body = {"prompt": "Once upon a time", "max_tokens": 100_000, "ignore_eos": True, "stream": stream}
    with client(tandem_server) as c:
        before = _wait_for(c, lambda s: s["server"]["running"] == 0)["server"]
        with _connect(tandem_server) as s:
            payload = httpx.Request("POST", tandem_server.root + "/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {tandem_server.api_key}"})
            head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + "".join(
                f"{k}: {v}\r\n" for k, v in payload.headers.items() if k.lower() != "host") + "\r\n"
            s.sendall(head.encode() + payload.read())
            _wait_for(c, lambda st: st["server"]["running"] == 1)
            time.sleep(1.0)  # tokens are flowing
        left = time.monotonic()
        after = _wait_for(c, lambda st: st["server"]["running"] == 0 and st["server"]["cancelled"] > before["cancelled"],
                          timeout_s=10)
        stopped_after = time.monotonic() - left
    record = [j for j in after["server"]["recent"] if j["outcome"] == "cancelled"][-1]
    assert record["finish_reason"] == "stopped" and 1 <= record["completion_tokens"] < 500, record
    assert stopped_after < 2.0


def test_a_request_joins_the_running_batch(tandem_server):
    """Batches used to be closed: a request arriving while one ran waited for all of it. Now a short
    request sent while a long one streams finishes long before the long one, its wait ~one step."""
    long_body = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}
    short_body = {"prompt": "1, 2, 3,", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    with client(tandem_server) as c:
        with c.stream("POST", "/v1/completions", json=long_body) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                got += line.startswith("data: ")
                if got >= 3:
                    break
            with client(tandem_server) as c2:
                t0 = time.monotonic()
                short = c2.post("/v1/completions", json=short_body)
                short_s = time.monotonic() - t0
                stats = c2.get("/v1/tandem/stats").json()["server"]
            assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 4
            assert stats["running"] == 1  # the long one is still going
            rest = sum(line.startswith("data: ") for line in lines)
    assert rest > 50, rest  # it went on well after the short one was answered
    record = [j for j in stats["recent"] if j["max_new_tokens"] == 4][-1]
    assert record["wait_s"] < 1.0 and short_s < 5.0, (record, short_s)
    assert stats["peak_batch"] >= 2
