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
    # float32: the dequantised reference path, exactly equal to transformers (dtype auto on a CPU keeps
    # the GGUF's blocks: tests/quant)
    engine = Engine(EngineConfig(model="builtin:smollm2-135m", backend="tandem", device="cpu", dtype="float32"))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def moe_engine():
    engine = Engine(EngineConfig(model="builtin:smollm2-135m-moe", backend="tandem", device="cpu", dtype="float32"))
    yield engine
    engine.close()

from server_fixtures import llamacpp_server, tandem_server  # noqa: E402,F401 — real servers (tests/server, tests/app)


# Test tiers. The tests below are the long ones on a 2-core machine (seconds from
# `python3 -m pytest --durations=60`, 2026-12-01, a shared 2-core machine); they are marked `slow` here,
# in one place, rather than in their files. `python3 -m pytest -q -m "not slow"` leaves them out for a
# quick development run; the README's command (and CI) runs everything. Patterns are node ids (fnmatch).
SLOW_TESTS = (
    "tests/installer/*",                                   # builds the PyInstaller bundle first (minutes)
    "tests/reliability/test_crash_safety.py::*",           # 20 kill -9s of the real app; a killed calibration
    "tests/reliability/test_soak.py::*",                   # 300 hybrid decode steps checked against resident
    # Whole-model decodes checked token for token against resident, per policy, cache size, batch:
    "tests/experts/test_expert_offload_builtin.py::*",     # 233 s in all (one `bench experts` run: 114 s)
    "tests/experts/test_zero_copy.py::*",                  # 77 s
    "tests/experts/test_cpu_mailbox.py::test_outputs_equal_resident_*",  # 5-6 s each
    "tests/kv/test_kv_generation.py::*",                   # 137 s (1,000 greedy tokens: 73 s)
    "tests/kv/test_resident_paged.py::*",                  # 26 s
    "tests/server/test_hostile_clients.py::test_a_request_joins_the_running_batch",  # 18 s
    "tests/test_cli.py::test_generate_answers_paris",      # 12-27 s
    "tests/models/test_synthetic.py::test_fifty_decode_steps_stay_finite",  # 20 s
    "tests/bench/test_suite.py::test_ab_against_*",        # a git worktree and three engine processes: 37 s
)


def pytest_collection_modifyitems(config, items):
    import fnmatch

    for item in items:
        if any(fnmatch.fnmatch(item.nodeid, pattern) for pattern in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
