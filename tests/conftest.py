import os

import pytest
import torch

# Without a GPU, Triton kernels run under Triton's interpreter on CPU tensors. The switch must be set
# before triton is first imported (its own library is decorated at import time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.api import Engine, EngineConfig  # noqa: E402


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
