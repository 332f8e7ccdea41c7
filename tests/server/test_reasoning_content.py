"""`tandem serve` on a harmony model (a tiny gpt-oss with a harmony template, its sampler scripted to
write a harmony reply): the reasoning comes back as reasoning_content beside the answer's content,
streamed and whole, and a completion of raw text is left as it is."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers").GptOssConfig  # noqa: B018 — this transformers has gpt-oss
from fastapi.testclient import TestClient
from harmony_helpers import REPLY, script_replies, tiny_gpt_oss_folder

from engine.api import Engine, EngineConfig
from engine.server.app import ServerSettings, create_app

KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200}


@pytest.fixture(scope="module")
def harmony_engine(tmp_path_factory):
    folder = tiny_gpt_oss_folder(tmp_path_factory.mktemp("gpt-oss") / "m")
    engine = Engine(EngineConfig(model=str(folder), backend="tandem", device="cpu", dtype="float32", max_batch=2))
    yield engine
    engine.close()


@pytest.fixture
def client(harmony_engine, monkeypatch):
    script_replies(monkeypatch, REPLY, harmony_engine.tokenizer)
    app = create_app(harmony_engine, ServerSettings(api_key=KEY, model_id="tiny-gpt-oss", rate_limit_per_min=0))
    with TestClient(app) as c:
        yield c
    app.state.queue.close()


def test_whole_reply_has_reasoning_content_beside_content(client):
    r = client.post("/v1/chat/completions", json=CHAT, headers=HEADERS)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Hello there!",
                       "reasoning_content": "The user greets; answer briefly."}
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_streamed_reply_sends_reasoning_deltas_then_content_deltas(client):
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=HEADERS) as r:
        assert r.status_code == 200
        lines = [ln[5:].strip() for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "[DONE]"
    deltas = [json.loads(ln)["choices"][0]["delta"] for ln in lines[:-1]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert reasoning == "The user greets; answer briefly." and content == "Hello there!"
    assert not any("reasoning_content" in d and "content" in d for d in deltas)  # one field per delta
    last_reasoning = max(i for i, d in enumerate(deltas) if "reasoning_content" in d)
    assert all(not d.get("content") for d in deltas[:last_reasoning])  # the reasoning comes first


def test_a_raw_completion_is_not_split_into_channels(client):
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 200}, headers=HEADERS)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert "The user greets" in text and "Hello there!" in text and "reasoning_content" not in r.json()["choices"][0]


def test_reasoning_sent_back_by_a_client_is_not_fed_to_the_model():
    from engine.server.schemas import ChatCompletionRequest

    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there!", "reasoning_content": "The user greets."},
        {"role": "user", "content": "Bye"}])
    assert body.to_generation(16).messages == [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Hello there!"},
                                               {"role": "user", "content": "Bye"}]


def test_the_remote_backend_reads_reasoning_content_back_apart(client, monkeypatch):
    """The app on another machine's Tandem (backend remote): the reasoning stays apart on this side too."""
    import httpx

    from engine.api import GenerationRequest, Reasoning
    from engine.backends.remote import RemoteBackend

    def through_app(headers=None, **_):
        client.headers.update(headers or {})
        return client

    monkeypatch.setattr(httpx, "Client", through_app)
    remote = RemoteBackend(EngineConfig(model="tiny-gpt-oss", backend="remote", remote_url="http://testserver/v1",
                                        remote_api_key=KEY))
    pieces = []
    result = remote.generate_batch([GenerationRequest(messages=CHAT["messages"], max_new_tokens=200)],
                                   lambda i, t: pieces.append(t), None)[0]
    assert (result.text, result.reasoning) == ("Hello there!", "The user greets; answer briefly.")
    assert "".join(p for p in pieces if isinstance(p, Reasoning)) == result.reasoning
    assert "".join(p for p in pieces if not isinstance(p, Reasoning)) == result.text
