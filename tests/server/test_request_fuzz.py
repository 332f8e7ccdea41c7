"""Fuzzing the request schema against the server's own routes: whatever a client sends — values of
the wrong type, out of range, NaN, huge integers, lone surrogates, unknown or unhonoured fields — the
answer is a 200 with a well-formed body or a 4xx with an OpenAI-style JSON error, never a 500."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SURROGATE = st.sampled_from(["\ud800", "a\udfffb", "\ud83d"])
TEXT = st.one_of(st.text(max_size=12), SURROGATE)
ANY_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                       st.floats(allow_nan=True, allow_infinity=True), TEXT)


def field(valid):
    """Mostly a plausible value, sometimes anything at all."""
    return st.one_of(valid, valid, ANY_SCALAR, st.lists(ANY_SCALAR, max_size=3))


SAMPLING = {
    "max_tokens": field(st.integers(1, 3)),
    "temperature": field(st.floats(0, 2.5)),
    "top_p": field(st.floats(0, 1.2)),
    "top_k": field(st.integers(-1, 60)),
    "repetition_penalty": field(st.floats(0, 12)),
    "seed": field(st.integers(-3, 2**65)),
    "stop": field(st.one_of(TEXT, st.lists(TEXT, max_size=6))),
    "n": field(st.integers(0, 2)),
    "stream": field(st.booleans()),
    "logprobs": field(st.booleans()),
    "ignore_eos": field(st.booleans()),
    "response_format": field(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "x"])})),
    "tool_choice": field(st.sampled_from(["none", "auto", "required"])),
    "frequency_penalty": field(st.floats(-3, 3)),
    "model": field(st.sampled_from(["builtin:smollm2-135m", "gpt-4", ""])),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": TEXT,
}
MESSAGE = st.fixed_dictionaries({"role": field(st.sampled_from(["system", "user", "assistant", "developer", "tool"])),
                                 "content": field(st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image_url"]), "text": TEXT}), max_size=2)))})
CHAT = st.fixed_dictionaries({"messages": field(st.lists(MESSAGE, min_size=0, max_size=3))},
                             optional=SAMPLING)
COMPLETION = st.fixed_dictionaries({"prompt": field(st.one_of(TEXT, st.lists(st.integers(-5, 60_000), max_size=6),
                                                              st.lists(TEXT, max_size=2)))},
                                   optional={**SAMPLING, "echo": field(st.booleans()), "suffix": TEXT,
                                             "best_of": field(st.integers(0, 2))})
TOKENIZE = st.fixed_dictionaries({}, optional={"prompt": field(TEXT), "messages": field(st.lists(MESSAGE, max_size=2))})
REQUESTS = st.one_of(st.tuples(st.just("/v1/chat/completions"), CHAT),
                     st.tuples(st.just("/v1/completions"), COMPLETION),
                     st.tuples(st.just("/tokenize"), TOKENIZE))


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(request=REQUESTS)
def test_any_request_body_gets_a_well_formed_answer(strict_server, request):
    path, body = request
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = max(-1, min(body["max_tokens"], 3))  # valid lengths stay short: a quick test
    else:
        body["max_tokens"] = 2 if path != "/tokenize" else body.get("max_tokens")
    raw = json.dumps(body, allow_nan=True).encode()  # NaN/Infinity as Python writes them; surrogates escaped
    headers = {"Authorization": f"Bearer {strict_server.api_key}", "Content-Type": "application/json"}
    r = httpx.post(strict_server.root + path, content=raw, headers=headers, timeout=60)
    assert r.status_code in (200, 400, 404), (r.status_code, r.text[:300], body)
    if r.status_code != 200:
        assert r.headers["content-type"] == "application/json", r.headers
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["message"], err
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    else:
        data = r.json()
        assert ("tokens" in data) if path == "/tokenize" else ("choices" in data and "usage" in data), data
