import pytest

from engine.api import Engine, EngineConfig


@pytest.fixture(scope="session")
def dense_engine():
    engine = Engine(EngineConfig(model="builtin:smollm2-135m", device="cpu"))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def moe_engine():
    engine = Engine(EngineConfig(model="builtin:smollm2-135m-moe", device="cpu"))
    yield engine
    engine.close()
