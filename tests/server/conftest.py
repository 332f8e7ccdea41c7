"""A second real server with short limits (timeouts of a second, four connections per address, a
two-second generation limit), for the tests that wait for a limit to apply."""

from __future__ import annotations

import pytest

from strict_limits import STRICT

from engine.server import launch


@pytest.fixture(scope="session")
def strict_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-strict") / "tandem-serve.log"
    flags = ["--backend", "tandem", "--device", "cpu", "--max-batch", "4", "--rate-limit", "0", "--quiet",
             "--header-timeout", str(STRICT["header_timeout"]), "--body-timeout", str(STRICT["body_timeout"]),
             "--max-connections", str(STRICT["max_connections"]), "--time-limit", str(STRICT["time_limit"])]
    server = launch.start_tandem("builtin:smollm2-135m", flags, log_path=str(log))
    yield server
    server.stop()
