"""The llama.cpp backend behind the same Engine interface, on the built-in GGUF."""

import threading

import pytest

from engine.api import Engine, EngineConfig, GenerationRequest, choose_backend
from engine.errors import ConfigError, ContextOverflowError, ModelFileError

pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def llama():
    engine = Engine(EngineConfig(model="builtin:smollm2-135m", backend="llamacpp", cpu_threads=2, max_context=1024))
    yield engine
    engine.close()


def test_answers_and_streams(llama):
    pieces = []
    res = llama.generate(GenerationRequest(prompt="Write one sentence about Paris.", max_new_tokens=24, greedy=True),
                         on_text=pieces.append)
    assert "Paris" in res.text and "".join(pieces) == res.text
    assert res.finish_reason in ("stop", "length") and res.decode_tok_s > 0
    snap = llama.stats().to_dict()
    assert snap["kernels"]["cpu_attention"] == "llama.cpp" and snap["speed"]["ttft_s"] > 0


def test_follow_up_turn_reuses_the_prefix(llama):
    turn1 = [{"role": "user", "content": "Name a fruit."}]
    r1 = llama.generate(GenerationRequest(messages=turn1, max_new_tokens=12, greedy=True, session_id="a"))
    turn2 = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "Another one?"}]
    r2 = llama.generate(GenerationRequest(messages=turn2, max_new_tokens=12, greedy=True, session_id="a"))
    assert r2.prefilled_tokens < r2.prompt_tokens - r1.prompt_tokens
    other = llama.generate(GenerationRequest(messages=turn2, max_new_tokens=12, greedy=True, session_id="b"))
    assert other.prefilled_tokens == other.prompt_tokens  # another chat never sees chat a's KV
    # (no token-equality check here: llama.cpp's batched and single-token kernels round differently,
    # so a reused prefix may change its greedy continuation)


def test_stop_event_and_context(llama):
    stop = threading.Event()
    res = llama.generate(GenerationRequest(prompt="Write a long essay about rivers.", max_new_tokens=200, greedy=True),
                         on_text=lambda t: stop.set(), stop_event=stop)
    assert res.finish_reason == "stopped" and res.completion_tokens <= 3
    with pytest.raises(ContextOverflowError):
        llama.generate_ids([1] * 2000, 4)


def test_refusals(tmp_path):
    with pytest.raises(ConfigError, match="upcycled"):
        Engine(EngineConfig(model="builtin:smollm2-135m-moe", backend="llamacpp"))
    with pytest.raises(ModelFileError, match="not found"):
        Engine(EngineConfig(model=str(tmp_path / "x.gguf"), backend="llamacpp"))


def test_auto_picks_llamacpp_only_for_plain_gguf_on_cpu():
    assert choose_backend(EngineConfig(model="/models/m.gguf", device="cpu")) == "llamacpp"
    assert choose_backend(EngineConfig(model="/models/m.gguf", device="cpu", simulate_hybrid=True)) == "tandem"
    assert choose_backend(EngineConfig(model="/models/m.gguf", backend="tandem")) == "tandem"
    assert choose_backend(EngineConfig(model="builtin:smollm2-135m", device="cpu")) == "tandem"
    assert choose_backend(EngineConfig(model="/models/folder", device="cpu")) == "tandem"


def test_the_amx_guard_turns_extra_buffers_off_only_inside_and_only_with_amx():
    """llama.cpp's AMX repacking crashed decode on an AMX machine (segfault in llama_decode); the
    backend loads models inside `amx_repack_off`, which restores llama-cpp-python afterwards."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from engine.backends.llamacpp import amx_repack_off
    from engine.hw.probe import cpu_flags

    low = llama_cpp.llama_cpp
    before = low.llama_model_default_params
    if not hasattr(before(), "use_extra_bufts"):
        pytest.skip("this llama-cpp-python has no use_extra_bufts")
    with amx_repack_off(llama_cpp):
        inside = low.llama_model_default_params().use_extra_bufts
    assert inside is ("amx_tile" not in cpu_flags())
    assert low.llama_model_default_params is before and before().use_extra_bufts


def test_decode_threads_are_measured_unless_the_config_fixes_them(llama, monkeypatch):
    """With the count left to it, the backend's decode steps feed the thread chooser, which sets
    llama.cpp's decode threads through llama_set_n_threads (prompts keep every core)."""
    import llama_cpp

    assert "cpu_threads_now" not in llama.info()  # the fixture fixes cpu_threads=2
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    # one core found busy at the start: the chooser begins on one thread and tries two within the reply
    monkeypatch.setattr("engine.runtime.thread_chooser.free_cores", lambda *a, **k: 1)
    calls = []
    real = llama_cpp.llama_set_n_threads
    monkeypatch.setattr(llama_cpp, "llama_set_n_threads", lambda ctx, n, n_batch: (calls.append((n, n_batch)),
                                                                                 real(ctx, n, n_batch)))
    engine = Engine(EngineConfig(model="builtin:smollm2-135m", backend="llamacpp", max_context=1024))
    try:
        res = engine.generate(GenerationRequest(prompt="Write one sentence about Paris.", max_new_tokens=32,
                                                greedy=True, ignore_eos=True))
        info = engine.info()
        assert res.completion_tokens == 32 and info["cpu_threads_max"] == 2 and info["cpu_thread_probes"] >= 1
        assert calls and all(n in (1, 2) and n_batch == 2 for n, n_batch in calls)
    finally:
        engine.close()
