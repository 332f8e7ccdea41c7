"""Starting `tandem serve` (or another OpenAI-compatible server) as a child process on a loopback
port, and waiting until it answers: what `tandem bench serve` and the tests use."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from engine.errors import TandemError


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the OS picks; a race with another process is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def new_api_key() -> str:
    return "tdm-" + secrets.token_urlsafe(32)


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str  # the OpenAI base, http://127.0.0.1:PORT/v1
    api_key: str
    log_path: str | None = None

    @property
    def root(self) -> str:
        return self.url[: -len("/v1")]

    def log_tail(self, chars: int = 3000) -> str:
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM (uvicorn then finishes open responses and closes), SIGKILL if it hangs."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


def wait_until_up(server: ServerProcess, path: str = "/v1/models", timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {server.api_key}"}
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise TandemError(f"the server exited with code {server.process.returncode} while starting",
                              f"its log ends:\n{server.log_tail()}")
        try:
            if httpx.get(server.root + path, headers=headers, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop()
    raise TandemError(f"the server did not answer within {timeout_s:.0f} s", f"its log ends:\n{server.log_tail()}")


def start(argv: list[str], port: int, api_key: str, log_path: str | None = None, env: dict | None = None,
          ready_path: str = "/v1/models", timeout_s: float = 120.0) -> ServerProcess:
    """Run `python -m <argv…>` (which must listen on 127.0.0.1:port and check api_key) and wait for it."""
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    finally:
        if log_path:
            log.close()
    server = ServerProcess(proc, f"http://127.0.0.1:{port}/v1", api_key, log_path)
    wait_until_up(server, ready_path, timeout_s)
    return server


def start_tandem(model: str, extra: list[str] | None = None, log_path: str | None = None,
                 api_key: str | None = None, timeout_s: float = 120.0) -> ServerProcess:
    """`tandem serve --model MODEL` on a free loopback port; the key goes by environment, not argv
    (other users of the machine can read argv)."""
    key = api_key or new_api_key()
    port = free_port()
    argv = ["engine.cli", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port), *(extra or [])]
    return start(argv, port, key, log_path, env={"TANDEM_API_KEY": key}, timeout_s=timeout_s)
