"""The official `openai` Python client against `tandem serve`."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture
def oa(tandem_server):
    c = openai.OpenAI(base_url=tandem_server.url, api_key=tandem_server.api_key, max_retries=0, timeout=60)
    yield c
    c.close()


def test_models_list(oa):
    assert [m.id for m in oa.models.list()] == ["builtin:smollm2-135m"]


def test_chat_completion(oa):
    r = oa.chat.completions.create(model="builtin:smollm2-135m", temperature=0, max_tokens=16,
                                   messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_completion_stream_with_usage(oa):
    stream = oa.chat.completions.create(model="builtin:smollm2-135m", temperature=0, max_tokens=8, stream=True,
                                        stream_options={"include_usage": True},
                                        messages=[{"role": "user", "content": "Say hello."}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].usage.completion_tokens <= 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_text_completion_stream(oa):
    pieces = [c.choices[0].text for c in oa.completions.create(model="builtin:smollm2-135m", prompt="1, 2, 3,",
                                                                max_tokens=6, temperature=0, stream=True)]
    whole = oa.completions.create(model="builtin:smollm2-135m", prompt="1, 2, 3,", max_tokens=6, temperature=0)
    assert "".join(pieces) == whole.choices[0].text and whole.usage.completion_tokens == 6


def test_errors_map_to_the_clients_exceptions(tandem_server, oa):
    bad = openai.OpenAI(base_url=tandem_server.url, api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="builtin:smollm2-135m", n=2, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
