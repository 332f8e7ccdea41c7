"""Reliability tests: a tiny chat model (random weights, the built-in model's real tokenizer and chat
template) loads in a second, so the app can be started, killed and restarted many times."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # crash_driver, reliability_helpers

from reliability_helpers import write_tiny_chat_model  # noqa: E402


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat")


@pytest.fixture(scope="session")
def chat_engine(chat_model):
    from engine.api import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(chat_model), backend="tandem", device="cpu", max_context=1024))
    yield engine
    engine.close()
