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


# Test tiers. The tests below take longer than ~20 s each on a 2-core machine (measured with
# `python3 -m pytest --durations=40`, figures in the comments); they are marked `slow` here, in one
# place, rather than in their files. `python3 -m pytest -q -m "not slow"` leaves them out for a quick
# development run; the README's command (and CI) runs everything. Patterns are node ids (fnmatch).
SLOW_TESTS = (
    "tests/installer/*",                                   # builds the PyInstaller bundle first (minutes)
    "tests/reliability/test_crash_safety.py::*",           # 20 kill -9s of the real app; a killed calibration
    "tests/reliability/test_soak.py::*",                   # 300 hybrid decode steps checked against resident
    "tests/bench/test_suite.py::test_ab_against_*",        # a git worktree and three engine processes (37 s)
)


def pytest_collection_modifyitems(config, items):
    import fnmatch

    for item in items:
        if any(fnmatch.fnmatch(item.nodeid, pattern) for pattern in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
