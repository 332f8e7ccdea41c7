"""Offline and local-only guarantees: generation, the app's main flows and calibration with every
network connection attempt turned into a failure; no unpickling anywhere; user files owner-only;
nothing listens on a network interface (an opt-in local server may bind 127.0.0.1 only)."""

import re
import socket
import stat
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "app"))
from gui_helpers import send_and_wait, set_chat  # noqa: E402

SOURCE_DIRS = ("engine", "app", "tests", "installer", "native")
SERVER_DIR = ROOT / "engine" / "server"  # the opt-in local server (127.0.0.1 only) lives here


@pytest.fixture
def no_network(monkeypatch):
    """Every connect / DNS lookup fails (as on a machine with no network); every attempt, bind and
    listen is recorded so that a caller who swallows the error is still caught."""
    attempts = []
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # the guarantee must not rest on these
        monkeypatch.delenv(var, raising=False)

    def refuse(kind):
        def fail(*args, **kwargs):
            attempts.append((kind, repr(args[1:] if kind.startswith("socket.") else args)[:120]))
            raise OSError(101, f"network disabled by the test ({kind})")
        return fail

    for name in ("connect", "connect_ex", "bind", "listen", "sendto"):
        monkeypatch.setattr(socket.socket, name, refuse(f"socket.{name}"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    return attempts


def private(path: Path) -> bool:
    return stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def listening() -> list:
    try:
        conns = psutil.Process().net_connections(kind="inet")
    except AttributeError:  # psutil < 6
        conns = psutil.Process().connections(kind="inet")
    return [c for c in conns if c.status == psutil.CONN_LISTEN]


def test_generation_app_and_calibration_offline(no_network, qtbot, tmp_path, monkeypatch, chat_engine, chat_model):
    from app.db import ChatStore
    from app.main_window import MainWindow
    from app.paths import DB_NAME, InstanceLock, data_dir
    from app.engine_host import EngineHost
    from engine.api import Engine, EngineConfig, GenerationRequest, calibrate, load_profile

    # generation: the built-in default model, from its file to text
    engine = Engine(EngineConfig(backend="tandem", device="cpu", max_context=256))
    reply = engine.generate(GenerationRequest(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                              max_new_tokens=8, greedy=True))
    engine.close()
    assert "Paris" in reply.text

    # the app: a fresh data folder, a chat sent and answered, exports written
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "fresh" / "data"))
    folder = data_dir()
    lock = InstanceLock(folder)
    assert lock.acquire() is None
    store = ChatStore(folder / DB_NAME)
    w = MainWindow(store, EngineHost(chat_engine))
    qtbot.addWidget(w)
    w.show()
    qtbot.waitUntil(lambda: w.host.state == "ready", timeout=60_000)
    set_chat(w, greedy=True, max_new_tokens=12)
    send_and_wait(qtbot, w, "Hello there")
    exports = [*w.export_chat_markdown(tmp_path / "chat.md"), *w.export_chat_json(tmp_path / "chat.json"),
               *w.export_stats(tmp_path / "stats.json")]
    assert listening() == []
    w.close()
    store.close()

    # calibration, saved to the default place in the data folder
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "fresh" / "engine-data"))
    calibrate("quick", model=str(chat_model))
    profile_path = tmp_path / "fresh" / "engine-data"
    assert load_profile() is not None

    assert no_network == [], no_network  # nothing even tried
    # owner-only: the folders created, the chat file and its journal, the lock, the profile, the exports
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(profile_path.stat().st_mode) == 0o700
    files = [p for p in folder.iterdir()] + list(profile_path.iterdir()) + exports
    assert any(p.name == DB_NAME for p in files) and any(p.name.endswith(".json") for p in profile_path.iterdir())
    assert [p for p in files if p.is_file() and not private(p)] == []
    lock.release()


BUILD_OUTPUTS = ("installer/build", "installer/dist")  # PyInstaller's copies of third-party code


def _sources():
    for d in SOURCE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")) if (ROOT / d).is_dir() else []:
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(BUILD_OUTPUTS):
                yield path, path.read_text(encoding="utf-8", errors="replace")


UNSAFE = re.compile(r"\bimport\s+(c?pickle|dill|joblib|shelve|marshal)\b|\bfrom\s+(c?pickle|dill|joblib|shelve)\s+import"
                    r"|\bpickle\.loads?\(|\btorch\.load\(|allow_pickle\s*=\s*True|weights_only\s*=\s*False"
                    r"|trust_remote_code\s*=\s*True")


def test_no_unpickling_anywhere():
    """Model files are safetensors or GGUF, read as data: nothing unpickles a file (torch.load, pickle,
    numpy allow_pickle, remote code), in the engine, the app, the tools or the tests."""
    me = Path(__file__).resolve()
    hits = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
            for p, text in _sources() if p.resolve() != me for m in UNSAFE.finditer(text)]
    assert hits == []


LISTEN = re.compile(r"\.listen\(|\.bind\(\s*\(|serve_forever|HTTPServer|create_server\(|uvicorn\.run|"
                    r"websockets\.serve|0\.0\.0\.0|host\s*=\s*['\"]{2}")


def test_nothing_listens_outside_the_opt_in_server():
    """No code outside engine/server/ opens a listening socket; the server, when present, binds the
    loopback address by default and never all interfaces."""
    hits = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p, text in _sources()
            if "tests" not in p.relative_to(ROOT).parts and SERVER_DIR not in p.parents
            for m in LISTEN.finditer(text)]
    assert hits == []
    server_files = sorted(SERVER_DIR.rglob("*.py")) if SERVER_DIR.is_dir() else []
    for path in server_files:
        text = path.read_text(encoding="utf-8")
        assert "0.0.0.0" not in text and not re.search(r"host\s*=\s*['\"]{2}", text), path
    if any(re.search(r"\.bind\(|create_server|HTTPServer|serve", p.read_text()) for p in server_files):
        assert any("127.0.0.1" in p.read_text() for p in server_files)
