"""Batching, stop event, chat sessions, sampling and stats of the runtime on the built-in model."""

import json
import threading

import pytest
import torch

from engine.api import GenerationRequest, StatsSnapshot
from engine.errors import ContextOverflowError
from engine.runtime.sampling import Sampler, SamplingParams

QUESTIONS = ["Hi!", "Name three colours of the rainbow, please.",
             "Write two sentences about the history of the city of Rome and its empire."]


def test_batch_of_three_equals_solo_runs(moe_engine):
    reqs = [GenerationRequest(prompt=q, max_new_tokens=16, greedy=True) for q in QUESTIONS]
    lengths = {len(moe_engine.prompt_ids(r)) for r in reqs}
    assert len(lengths) == 3  # really different lengths
    batch = moe_engine.generate_batch(reqs)
    for req, res in zip(reqs, batch):
        assert res.token_ids == moe_engine.generate(req).token_ids


def test_stop_event_ends_within_one_step(dense_engine):
    stop = threading.Event()

    def on_text(t):
        if not stop.is_set():
            stop.set()  # as the UI's Stop button would, from the first streamed text

    req = GenerationRequest(prompt="Write a long essay about the sea.", max_new_tokens=200, greedy=True)
    res = dense_engine.generate(req, on_text=on_text, stop_event=stop)
    assert res.finish_reason == "stopped"
    assert res.completion_tokens <= 3  # the event was seen before the next decode step
    # a stop set before the call ends it before any decode step
    res2 = dense_engine.generate(req, stop_event=stop)
    assert res2.finish_reason == "stopped" and res2.completion_tokens == 0


def test_second_turn_prefills_only_new_tokens(moe_engine):
    turn1 = [{"role": "user", "content": "What is the capital of France?"}]
    r1 = moe_engine.generate(GenerationRequest(messages=turn1, max_new_tokens=24, greedy=True, session_id="s1"))
    assert r1.prefilled_tokens == r1.prompt_tokens
    turn2 = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And of Italy?"}]
    r2 = moe_engine.generate(GenerationRequest(messages=turn2, max_new_tokens=24, greedy=True, session_id="s1"))
    new_tokens = r2.prompt_tokens - r1.prompt_tokens - r1.completion_tokens
    assert r2.prefilled_tokens <= new_tokens + 3  # only the new message (+ the template's seams)
    fresh = moe_engine.generate(GenerationRequest(messages=turn2, max_new_tokens=24, greedy=True))
    assert fresh.prefilled_tokens == fresh.prompt_tokens
    assert r2.token_ids == fresh.token_ids
    # regenerate: the same history again crops back to it instead of starting over
    r3 = moe_engine.generate(GenerationRequest(messages=turn2, max_new_tokens=24, greedy=True, session_id="s1"))
    assert r3.prefilled_tokens == 1 and r3.token_ids == r2.token_ids
    # edit an earlier message: prefill starts where the histories part
    edited = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And of Spain?"}]
    r4 = moe_engine.generate(GenerationRequest(messages=edited, max_new_tokens=8, greedy=True, session_id="s1"))
    assert r4.prefilled_tokens < r4.prompt_tokens - r1.prompt_tokens
    moe_engine.end_session("s1")


def test_kv_blocks_return_to_the_pool(moe_engine):
    kv = moe_engine.backend.parts.kv
    before = kv.allocator.n_free
    moe_engine.generate(GenerationRequest(prompt="Count to five.", max_new_tokens=8, greedy=True, session_id="k"))
    assert kv.allocator.n_free < before
    moe_engine.end_session("k")
    assert kv.allocator.n_free == before


def test_prompt_longer_than_context_is_refused(dense_engine):
    too_long = [1] * (dense_engine.max_context + 5)
    with pytest.raises(ContextOverflowError, match="context window"):
        dense_engine.generate_ids(too_long, 4)
    # the engine is still usable afterwards
    assert len(dense_engine.generate_ids([1, 2, 3], 2)) >= 1


def test_seeded_sampling_reproduces_and_topk1_is_greedy(dense_engine):
    ids = dense_engine.render([{"role": "user", "content": "Tell me a joke."}])
    a = dense_engine.generate_ids(ids, 12, greedy=False, temperature=1.0, seed=7)
    b = dense_engine.generate_ids(ids, 12, greedy=False, temperature=1.0, seed=7)
    assert a == b
    assert dense_engine.generate_ids(ids, 12, greedy=False, temperature=1.0, top_k=1, seed=3) == \
        dense_engine.generate_ids(ids, 12)


def test_repetition_penalty_changes_the_text(dense_engine):
    ids = dense_engine.render([{"role": "user", "content": "Repeat the word cat ten times."}])
    plain = dense_engine.generate_ids(ids, 24)
    penalised = dense_engine.generate_ids(ids, 24, repetition_penalty=1.8)
    assert plain != penalised


def test_stop_strings_cut_the_text(dense_engine):
    req = GenerationRequest(prompt="What is the capital of France?", max_new_tokens=24, greedy=True, stop=["Paris"])
    pieces = []
    res = dense_engine.generate(req, on_text=pieces.append)
    assert res.finish_reason == "stop"
    assert "Paris" not in res.text and res.text.strip()
    assert "".join(pieces) == res.text


SECTION_KEYS = {
    "vram": {"weights", "expert_cache", "kv_dwindow", "kv_pingpong", "kv_resident", "workspace", "budget",
             "device_total", "device_used"},
    "host": {"kv_pinned", "kv_unpinned", "expert_store", "expert_store_types", "rss"},
    "kv": {"tokens", "r_target", "r_deployed", "A_ns_per_token", "B_ns_per_token", "delta_ms"},
    "experts": {"hits", "misses", "fills", "cpu_executed", "evictions", "prefetch_used", "prefetch_wasted",
                "hit_rate"},
    "pcie": {"h2d_bytes", "d2h_bytes", "h2d_gbps", "d2h_gbps"},
    "speed": {"prefill_tok_s", "decode_tok_s", "ttft_s"},
    "kernels": {"cpu_attention", "cpu_experts"},
}


def test_stats_snapshot_serialises_with_every_key(moe_engine):
    moe_engine.generate(GenerationRequest(prompt="Hello", max_new_tokens=4, greedy=True))
    snap = moe_engine.stats()
    assert isinstance(snap, StatsSnapshot)
    data = json.loads(snap.to_json())
    assert {"phase", "vram", "host", "kv", "experts", "pcie", "speed", "kernels", "profile"} <= set(data)
    for section, keys in SECTION_KEYS.items():
        assert keys <= set(data[section]), section
    assert set(data["kv"]["tokens"]) >= {"dwindow", "pinned", "unpinned", "resident"}
    assert data["phase"] == "idle"
    assert data["speed"]["decode_tok_s"] > 0 and data["host"]["rss"] > 0
    assert data["kernels"]["cpu_attention"] == "torch-sdpa"
    if data["vram"]["device_total"] is None:  # CPU run: no VRAM figure is reported as 0
        assert all(v is None for v in data["vram"].values())


def test_host_pinned_bytes_count_the_kv_staging_buffer():
    """The host panel's "KV pinned" is every page-locked byte the KV holds: the load region and the
    write-back staging buffer (which a 32K prefill can make gigabytes)."""
    import torch

    from engine.runtime.telemetry import Telemetry

    snap = Telemetry().snapshot(device=torch.device("cpu"), weights_bytes=0,
                                kv_tel={"bytes": {"kv_pinned": 100, "kv_staging": 50, "kv_unpinned": 7}},
                                experts_tel=None, vram_budget_bytes=None, model_info={}, profile=None)
    assert snap.host["kv_pinned"] == 150 and snap.host["kv_unpinned"] == 7


def test_a_sequence_ending_before_the_others_leaves_its_kv_as_its_session_says(dense_engine):
    """Decode runs a step ahead of the host: a sequence whose stop string ends it has been fed its last
    token once more. That KV entry must be cropped, or the session's next turn would reuse it."""
    gen, kv = dense_engine.backend.generator, dense_engine.backend.parts.kv
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    reqs = [GenerationRequest(messages=ask, max_new_tokens=24, greedy=True, stop=["Paris"], session_id="a"),
            GenerationRequest(messages=ask, max_new_tokens=24, greedy=True, session_id="b")]
    first, second = dense_engine.generate_batch(reqs)
    assert first.finish_reason == "stop" and second.completion_tokens > first.completion_tokens
    for key, res in (("a", first), ("b", second)):
        s = gen.sessions[key]
        prompt = dense_engine.prompt_ids(reqs[0])
        assert s.cached == prompt + res.token_ids[:-1]  # every token but the last, which no step was fed
        assert kv.length(s.seq_id) == len(s.cached)
        dense_engine.end_session(key)


def test_decode_tokens_equal_one_step_at_a_time(dense_engine):
    """The same tokens as sampling each step's token before launching the next (seeded sampling, a
    repetition penalty reading the history)."""
    ids = dense_engine.render([{"role": "user", "content": "Say something about rivers."}])
    piped = dense_engine.generate_ids(ids, 20, greedy=False, temperature=0.9, seed=11, repetition_penalty=1.3)
    gen = dense_engine.backend.generator
    sampler = Sampler(SamplingParams(temperature=0.9, seed=11, repetition_penalty=1.3))
    s = gen.session(None)
    with torch.inference_mode():
        out = [sampler(gen._forward([s], torch.tensor([ids]))[0], ids)]
        while len(out) < len(piped):
            logits = gen._forward([s], torch.tensor([[out[-1]]]))[0]
            out.append(sampler(logits, ids + out))
    gen.kv.free(s.seq_id)
    assert len(piped) >= 2 and out == piped


def test_decode_that_reaches_the_context_ends_with_context_full():
    """A step ahead of the host, the sequence whose next token would not fit is left out of the step
    while its last token is in flight; once that token is read it ends as context_full (an app chat
    whose history had grown to the window failed here with an error instead)."""
    from engine.api import Engine, EngineConfig

    engine = Engine(EngineConfig(model="builtin:smollm2-135m", backend="tandem", device="cpu", max_context=64))
    try:
        room = 3
        ids = [1] * (engine.max_context - room)
        res = engine.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=20, greedy=True, ignore_eos=True))
        assert res.finish_reason == "context_full"
        assert res.completion_tokens == room + 1  # the prefill's token, then one a step while the KV had room
    finally:
        engine.close()
