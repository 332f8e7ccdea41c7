"""Fault injection on the engine: damaged files, impossible budgets, allocation refusals and compute
failures mid-step. Each gives a TandemError whose `what` names the cause and whose `remedy` says
what to do, and the engine (or a fresh one) stays usable."""

import errno
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers.py
from helpers import write_tiny_llama_folder, write_tiny_llama_gguf  # noqa: E402

from engine.api import Engine, EngineConfig  # noqa: E402
from engine.errors import (ComputeError, ConfigError, ModelFileError, OutOfMemoryError,  # noqa: E402
                           TandemError, UnsupportedModelError)

PROMPT = list(range(3, 40))
HYBRID = dict(backend="tandem", device="cpu", simulate_hybrid=True, kv_policy="fixed:0.5", d_window=16,
              block_size=16, max_context=256, max_batch=2)


def engine_for(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), **{"backend": "tandem", "device": "cpu", **kw}))


def assert_explained(e: TandemError, *words: str) -> None:
    assert e.what and e.remedy, e
    for w in words:
        assert w in str(e), (w, str(e))
    assert "Traceback" not in str(e)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_llama_folder(tmp_path_factory.mktemp("m") / "tiny")


@pytest.mark.parametrize("damage", ["truncate-header", "truncate-data", "garble-header", "garble-magic"])
def test_damaged_gguf(tmp_path, damage):
    good = write_tiny_llama_gguf(tmp_path / "good.gguf").read_bytes()
    bad = bytearray(good)
    if damage == "truncate-header":
        bad = bad[:300]
    elif damage == "truncate-data":
        bad = bad[:len(good) - 1000]
    elif damage == "garble-header":
        bad[24:64] = b"\xff" * 40  # the key/value count and first key: nonsense lengths
    else:
        bad[0:4] = b"XXXX"
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(bad))
    with pytest.raises(ModelFileError) as e:
        engine_for(path)
    assert_explained(e.value, str(path))
    assert "again" in e.value.remedy


@pytest.mark.parametrize("damage", ["truncate", "garble-header", "empty"])
def test_damaged_safetensors(tmp_path, folder, damage):
    import shutil

    copy = shutil.copytree(folder, tmp_path / "m")
    st = copy / "model.safetensors"
    data = bytearray(st.read_bytes())
    if damage == "truncate":
        data = data[:len(data) * 2 // 3]
    elif damage == "garble-header":
        data[8:40] = b"\x00\xff" * 16
    else:
        data = bytearray()
    st.write_bytes(bytes(data))
    with pytest.raises(ModelFileError) as e:
        engine_for(copy)
    assert_explained(e.value, "model.safetensors", "could not be read")


def test_unknown_architecture_in_config(tmp_path, folder):
    import shutil

    copy = shutil.copytree(folder, tmp_path / "m")
    (copy / "config.json").write_text((copy / "config.json").read_text().replace('"llama"', '"warp_drive_lm"'))
    with pytest.raises(UnsupportedModelError) as e:
        engine_for(copy)
    assert_explained(e.value, "warp_drive_lm")


def test_missing_tokenizer_is_explained_on_chat_use(folder):
    engine = engine_for(folder)
    assert len(engine.generate_ids(PROMPT, 3)) == 3  # ids-only use works
    with pytest.raises(ConfigError) as e:
        engine.render([{"role": "user", "content": "hi"}])
    assert_explained(e.value, "no tokenizer")


def test_vram_budget_too_small_for_the_dense_weights(folder):
    """Explicit GPU policies are refused with the sizes; the default plan runs the model on the CPU."""
    with pytest.raises(OutOfMemoryError) as e:
        engine_for(folder, simulate_hybrid=True, vram_budget_gb=1e-5, kv_policy="resident", expert_policy="resident")
    assert_explained(e.value, "weights", "VRAM budget", "vram_budget_gb")
    assert "raise vram_budget_gb" in e.value.remedy
    engine = engine_for(folder, simulate_hybrid=True, vram_budget_gb=1e-5)
    assert engine.info()["plan"]["device"] == "cpu" and engine.backend.config.simulate_hybrid is False
    assert len(engine.generate_ids(PROMPT, 3)) == 3


def test_pinned_pool_exhausted_routes_to_the_cpu(folder, monkeypatch):
    """The host refuses page-locked memory: placed KV goes to the pageable CPU region instead, and the
    tokens are those of an engine whose pinned pool never ran out."""
    from engine.kv import transport as transport_mod

    reference = engine_for(folder, **HYBRID).generate_ids(PROMPT, 60)
    real_host = transport_mod.Transport.host

    def refuse_pinned(self, shape, dtype, pinned):
        if pinned:
            raise OutOfMemoryError("cannot page-lock host memory (injected)", "raise ulimit -l")
        return real_host(self, shape, dtype, pinned=pinned)

    monkeypatch.setattr(transport_mod.Transport, "host", refuse_pinned)
    from engine.api import GenerationRequest

    engine = engine_for(folder, **HYBRID)
    req = GenerationRequest(prompt_ids=PROMPT, max_new_tokens=60, greedy=True, session_id="kept")
    assert engine.generate(req).token_ids == reference
    tokens = engine.stats().to_dict()["kv"]["tokens"]  # the session's KV is still placed
    assert tokens["pinned"] == 0 and tokens["unpinned"] > 0, tokens


def _fail_on_call(monkeypatch, module, name: str, n: int, error: Exception) -> dict:
    real, calls = getattr(module, name), {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, flaky)
    return calls


@pytest.mark.parametrize("side,name,error,words", [
    ("cpu", "attend_blocks", RuntimeError("injected CPU kernel fault"), ("compute kernel failed", "injected")),
    ("gpu", "attend_dense", RuntimeError("CUDA error: an illegal memory access was encountered"),
     ("GPU reported an error", "illegal memory access")),
    ("cpu", "attend_blocks", KeyError((3, 12)), ("internal error", "KeyError: (3, 12)")),
])
def test_compute_failure_mid_decode(folder, monkeypatch, side, name, error, words):
    """A kernel raises in the middle of a decode step: the reply ends with a ComputeError (or an
    OutOfMemoryError), the step's KV is dropped, and the same engine then generates exactly what
    it generated before the fault."""
    import engine.kv.writescope as writescope
    from engine.api import GenerationRequest

    engine = engine_for(folder, **HYBRID)
    before = engine.generate_ids(PROMPT, 40)
    calls = _fail_on_call(monkeypatch, writescope, name, 10, error)  # into decode (2 layers per step)
    streamed = []
    with pytest.raises(ComputeError) as e:
        engine.generate(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=40, greedy=True, session_id="chat"),
                        on_text=streamed.append)
    assert calls["n"] == 10
    assert_explained(e.value, *words)
    assert "try again" in e.value.remedy
    assert ("TANDEM_NATIVE=0" in e.value.remedy) == ("compute kernel failed" in words)  # kernels only
    monkeypatch.undo()
    assert engine.generate_ids(PROMPT, 40) == before
    assert engine.generate_ids(PROMPT, 40, greedy=True) == before  # the failed session's KV was dropped


def test_out_of_memory_mid_decode(folder, monkeypatch):
    import engine.kv.writescope as writescope

    engine = engine_for(folder, **HYBRID)
    before = engine.generate_ids(PROMPT, 30)
    _fail_on_call(monkeypatch, writescope, "attend_dense", 30, torch.OutOfMemoryError("injected: out of memory"))
    with pytest.raises(OutOfMemoryError) as e:
        engine.generate_ids(PROMPT, 30)
    assert_explained(e.value, "memory ran out", "max_context")
    monkeypatch.undo()
    assert engine.generate_ids(PROMPT, 30) == before


def test_full_disk_when_saving_a_profile(tmp_path, monkeypatch):
    """The disk fills while the new profile is written: a ProfileError says so, the old profile is
    untouched and still loads, and no temporary file is left behind."""
    import json

    from engine.hw import profile as hw_profile

    path = tmp_path / "machine.json"
    old = {"schema_version": hw_profile.SCHEMA_VERSION, "created_utc": "old", "shapes": {}}
    path.write_text(json.dumps(old))
    before = path.read_bytes()

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hw_profile.os, "fsync", no_space)
    with pytest.raises(hw_profile.ProfileError) as e:
        hw_profile.save({**old, "created_utc": "new"}, path)
    assert_explained(e.value, str(path), "No space left")
    assert "previous profile" in e.value.remedy
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["machine.json"]
