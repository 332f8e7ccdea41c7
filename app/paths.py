"""Where the app keeps its files, and the lock that keeps a second instance off the same data.

The data dir is `$TANDEM_DATA_DIR` when set (tests, portable installs), else platformdirs' user data
dir for "tandem". It holds `chats.sqlite3` (chats, messages, settings) and `tandem.lock`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QLockFile

DB_NAME = "chats.sqlite3"
LOCK_NAME = "tandem.lock"


class DataDirError(Exception):
    """The data folder cannot be created or written: what and remedy, shown instead of a traceback."""

    def __init__(self, what: str, remedy: str):
        self.what, self.remedy = what, remedy
        super().__init__(f"{what} — {remedy}")


def data_dir(override: str | os.PathLike | None = None) -> Path:
    """The data folder, created owner-only (0700) when it does not exist yet."""
    import platformdirs

    path = Path(override or os.environ.get("TANDEM_DATA_DIR") or platformdirs.user_data_dir("tandem"))
    if not path.is_dir():
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise DataDirError(f"the data folder {path} cannot be created ({e.strerror or e})",
                               "start Tandem with --data-dir (or TANDEM_DATA_DIR) pointing at a writable folder") from e
    return path


def check_writable(path: Path) -> None:
    """Raise DataDirError unless a file can be created in `path` (read-only disks, wrong owner)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise DataDirError(f"the data folder {path} is not writable ({e.strerror or e}); chats and settings "
                           "cannot be saved there",
                           "make it writable (check its owner, permissions and free space), or start Tandem with "
                           "--data-dir (or TANDEM_DATA_DIR) pointing at a writable folder") from e


@dataclass
class LockHolder:
    pid: int
    hostname: str
    appname: str

    def describe(self) -> str:
        here = "this computer" if self.hostname in ("", socket.gethostname()) else self.hostname
        return f"process {self.pid} on {here}" if self.pid > 0 else "another process"


class InstanceLock:
    """One app instance per data dir. A lock left by a killed process is stale and taken over."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_NAME
        self._lock = QLockFile(str(self.path))
        self._lock.setStaleLockTime(0)  # staleness is decided by whether the holder's pid still runs

    def acquire(self) -> LockHolder | None:
        """Take the lock; None on success, else who holds it."""
        if self._lock.tryLock(0):
            try:
                os.chmod(self.path, 0o600)  # owner-only, like every file Tandem writes in the data folder
            except OSError:
                pass
            return None
        info = self._lock.getLockInfo()  # (pid, host, app); some bindings prepend an ok flag
        if len(info) == 4:
            info = info[1:] if info[0] else (-1, "", "")
        pid, host, app = info
        return LockHolder(int(pid or -1), host or "", app or "")

    def release(self) -> None:
        if self._lock.isLocked():
            self._lock.unlock()


# -- secrets: API keys kept beside the data, readable by the owner only ----------------------------
SERVER_KEY_NAME = "server_api_key"  # the key `tandem serve` started from the app requires
REMOTE_KEY_NAME = "remote_api_key"  # the key the app sends to a remote server


def read_secret(directory: Path, name: str) -> str | None:
    try:
        return (Path(directory) / name).read_text().strip() or None
    except OSError:
        return None


def write_secret(directory: Path, name: str, value: str) -> Path:
    """Write atomically with mode 0600 from the first byte (never briefly world-readable)."""
    path = Path(directory) / name
    tmp = path.with_name(f".{name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)  # O_CREAT's mode is filtered by the umask; also fixes a pre-existing file
    os.replace(tmp, path)
    return path


def server_key(directory: Path, renew: bool = False) -> str:
    """The local server's API key: generated on first use (or when renewed) and kept."""
    import secrets

    key = None if renew else read_secret(directory, SERVER_KEY_NAME)
    if key is None:
        key = "tdm-" + secrets.token_urlsafe(32)
        write_secret(directory, SERVER_KEY_NAME, key)
    return key
