"""Real servers on loopback ports, started once per test session: `tandem serve` on the built-in
dense model, and llama-cpp-python's own OpenAI-compatible server on the same GGUF file. Shared by
tests/server and tests/app through tests/conftest.py."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from engine.server import launch

# Low enough that the rate-limit test reaches it in a moment, high enough for the whole session's
# requests with the right key (their bucket is apart from wrong-key requests).
RATE_LIMIT_PER_MIN = 120


@pytest.fixture(scope="session")
def tandem_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "tandem-serve.log"
    server = launch.start_tandem("builtin:smollm2-135m", ["--backend", "tandem", "--device", "cpu", "--max-batch", "4",
                                                           "--rate-limit", str(RATE_LIMIT_PER_MIN), "--quiet"],
                                 log_path=str(log))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llamacpp_server(tmp_path_factory):
    missing = [m for m in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings", "uvicorn")
               if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"llama-cpp-python's server needs {', '.join(missing)} (pip install -e .[test])")
    from engine.models.builtin import smollm2_gguf

    key, port = launch.new_api_key(), launch.free_port()
    log = tmp_path_factory.mktemp("llamacpp") / "llama-server.log"
    argv = ["tests.llamacpp_server", "--model", str(smollm2_gguf()), "--host", "127.0.0.1", "--port", str(port),
            "--api_key", key, "--n_ctx", "2048", "--n_threads", "2", "--model_alias", "smollm2-135m"]
    root = str(Path(__file__).resolve().parents[1])  # `tests.llamacpp_server` from any working directory
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    server = launch.start(argv, port, key, str(log), env={"PYTHONPATH": path})
    yield server
    server.stop()
