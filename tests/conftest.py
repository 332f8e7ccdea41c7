import pytest

from engine.api import Engine, EngineConfig


@pytest.fixture(scope="session")
def dense_engine():
    engine = Engine(EngineConfig(model="builtin:smollm2-135m", backend="tandem", device="cpu"))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def moe_engine():
    engine = Engine(EngineConfig(model="builtin:smollm2-135m-moe", backend="tandem", device="cpu"))
    yield engine
    engine.close()

from server_fixtures import llamacpp_server, tandem_server  # noqa: E402,F401 — real servers (tests/server, tests/app)
