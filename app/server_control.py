"""The local OpenAI-compatible server, started and stopped from the app (Settings → Local API server).

It runs as a child process (`python -m engine.cli serve …`) with its own engine, so a crash or a
long request there never touches the chat window, and quitting the app stops it. The key travels
in the environment (TANDEM_API_KEY), not on the command line, where other users could read it.
The server prints "Tandem serving … at URL" on stderr once it listens; that line marks it running.
"""

from __future__ import annotations

import re
import sys

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer, Signal

READY = re.compile(r"Tandem serving (\S+) at (http://\S+)")
DEFAULT_PORT = 8642


class ServerControl(QObject):
    state_changed = Signal(str)  # stopped | starting | running | failed
    log_line = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.process: QProcess | None = None
        self.state = "stopped"
        self.url: str | None = None
        self.model: str | None = None
        self.error: str | None = None
        self.log: list[str] = []
        self._buffer = ""

    def _set(self, state: str) -> None:
        self.state = state
        self.state_changed.emit(state)

    def command(self, model: str, port: int, host: str = "127.0.0.1", extra: list[str] | None = None) -> list[str]:
        # In the desktop bundle (installer/) sys.executable is the `tandem` executable itself, not a Python.
        launcher = [sys.executable] if getattr(sys, "frozen", False) else [sys.executable, "-m", "engine.cli"]
        return [*launcher, "serve", "--model", model, "--host", host, "--port", str(port), *(extra or [])]

    def start(self, model: str, port: int, api_key: str, extra: list[str] | None = None) -> None:
        if self.process is not None:
            return
        self.url, self.model, self.error, self.log, self._buffer = None, model, None, [], ""
        argv = self.command(model, port, extra=extra)
        p = QProcess(self)
        env = QProcessEnvironment.systemEnvironment()
        env.insert("TANDEM_API_KEY", api_key)
        p.setProcessEnvironment(env)
        p.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        p.readyReadStandardOutput.connect(self._read)
        p.finished.connect(self._finished)
        p.errorOccurred.connect(self._error)
        self.process = p
        self._set("starting")
        p.start(argv[0], argv[1:])

    def stop(self, timeout_ms: int = 10_000) -> None:
        """SIGTERM (the server finishes and closes), SIGKILL when it does not end in time."""
        p = self.process
        if p is None:
            return
        p.terminate()
        if not p.waitForFinished(timeout_ms):
            p.kill()
            p.waitForFinished(2000)

    def _read(self) -> None:
        self._buffer += bytes(self.process.readAllStandardOutput()).decode(errors="replace")
        *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            self.log = (self.log + [line])[-200:]
            self.log_line.emit(line)
            m = READY.search(line)
            if m and self.state == "starting":
                self.url = m.group(2)
                self._set("running")

    def _error(self, err) -> None:
        if err == QProcess.ProcessError.FailedToStart:
            self.error = f"the server could not start ({self.process.errorString()})"

    def _finished(self, code: int, _status) -> None:
        failed = self.state == "starting" or (code not in (0, 15, -15) and self.state != "stopped")
        if failed and self.error is None:
            tail = [ln for ln in self.log if ln.startswith(("error:", "what to do:"))] or self.log[-3:]
            self.error = " ".join(tail) or f"the server exited with code {code}"
        self.process.deleteLater()
        self.process, self.url = None, None
        QTimer.singleShot(0, lambda: self._set("failed" if failed else "stopped"))
