"""Faults seen from the app: a full disk while saving a chat, a read-only data folder, a second
instance on the same data, a reply whose compute fails mid-way, a model without a tokenizer. Each
is told in words (cause and remedy), no traceback reaches the user, the app stays usable and
nothing already saved is lost."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reliability_helpers import PYTHON, ROOT, subprocess_env

sys.path.insert(0, str(ROOT / "tests" / "app"))
from gui_helpers import send_and_wait, set_chat  # noqa: E402

from app.db import ChatStore, StoreError  # noqa: E402
from app.main_window import MainWindow  # noqa: E402
from app.paths import DB_NAME, InstanceLock  # noqa: E402
from app.engine_host import EngineHost  # noqa: E402


@pytest.fixture
def window(qtbot, tmp_path, chat_engine):
    data = tmp_path / "data"
    data.mkdir()
    store = ChatStore(data / DB_NAME)
    w = MainWindow(store, EngineHost(chat_engine))
    qtbot.addWidget(w)
    w.show()
    qtbot.waitUntil(lambda: w.host.state == "ready", timeout=60_000)
    set_chat(w, greedy=True, max_new_tokens=8)
    yield w
    if w.host.state != "closed":
        w.close()
    store.close()


def rows(store):
    return store.conn.execute("SELECT id, role, content, status FROM messages ORDER BY id").fetchall()


def test_disk_full_when_saving_a_chat(qtbot, window):
    w = window
    send_and_wait(qtbot, w, "First question")
    saved = [tuple(r) for r in rows(w.store)]
    # the file may not grow by a single page: SQLite's own "database or disk is full" path
    pages = w.store.conn.execute("PRAGMA page_count").fetchone()[0]
    w.store.conn.execute(f"PRAGMA max_page_count={pages}")
    long = "information " * 420  # > one 4 KiB page of text, < the context window in tokens
    w.composer.edit.setPlainText(long)
    w.composer.send_btn.click()
    qtbot.waitUntil(lambda: "Not sent" in w.statusBar().currentMessage(), timeout=30_000)
    msg = w.statusBar().currentMessage()
    assert "disk" in msg and "full" in msg and "free some disk space" in msg and "Traceback" not in msg
    assert [tuple(r) for r in rows(w.store)] == saved  # nothing saved was lost, nothing half-written
    assert w.composer.text() == long  # the draft is kept for a retry
    assert w.store.integrity() == "ok"
    with pytest.raises(StoreError, match="disk holding .* is full"):  # direct callers get the same words
        w.store.add_message(w.conv.chat_id, "user", long)
    # space again: the same draft goes out, the app never needed a restart
    w.store.conn.execute("PRAGMA max_page_count=1073741823")
    result = send_and_wait(qtbot, w, long)
    last = [tuple(r)[1:] for r in rows(w.store)][-2:]
    assert last[0][0] == "user" and last[0][1].strip() == long.strip() and last[0][2] == "done"
    assert last[1] == ("assistant", result["text"], "done")


def test_reply_failing_mid_way_keeps_the_chat_and_the_app(qtbot, window, monkeypatch):
    w = window
    send_and_wait(qtbot, w, "First question")
    saved = [tuple(r) for r in rows(w.store)]
    kv = w.host.worker.engine.parts.kv
    real, calls = kv.attend, {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 9:  # a few decode steps in (2 layers per step)
            raise RuntimeError("CUDA error: unspecified launch failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(kv, "attend", failing)
    set_chat(w, max_new_tokens=40)
    w.composer.edit.setPlainText("Second question")
    with qtbot.waitSignal(w.conv.reply_finished, timeout=60_000) as blocker:
        w.composer.send_btn.click()
    status, result = blocker.args
    assert status == "error" and "GPU reported an error" in result["what"] and "try again" in result["remedy"]
    assert "Traceback" not in result["what"] + result["remedy"]
    assert "The reply failed" in w.statusBar().currentMessage()
    now = [tuple(r) for r in rows(w.store)]
    assert now[:len(saved)] == saved and now[-1][1] == "assistant" and now[-1][3] == "error"
    monkeypatch.undo()
    send_and_wait(qtbot, w, "Third question")  # usable again


def test_model_without_tokenizer_is_refused_with_a_reason(qtbot, tmp_path, chat_model):
    bare = shutil.copytree(chat_model, tmp_path / "bare")
    for p in bare.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            p.unlink()
    store = ChatStore(tmp_path / DB_NAME)
    w = MainWindow(store, EngineHost(), {"model": str(bare), "device": "cpu"})
    qtbot.addWidget(w)
    w.show()
    w.load_model()
    qtbot.waitUntil(lambda: w.host.state == "failed", timeout=60_000)
    text = w.banner_text.text()
    assert "has no tokenizer" in text and "tokenizer.json" in text and "Traceback" not in text
    store.add_message(store.chats()[0].id, "user", "hello")  # a chat in use: "New chat" makes another
    w.chat_list.new_chat()  # still usable
    assert len(store.chats()) == 2
    w.close()
    store.close()


def run_app(data: Path, *args, wrap: list[str] | None = None) -> subprocess.CompletedProcess:
    code = "import sys; from app.main import main; sys.exit(main(sys.argv[1:]))"
    cmd = [*(wrap or []), PYTHON, "-c", code, "--data-dir", str(data), "--skip-wizard", *args]
    return subprocess.run(cmd, env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)


def read_only(data: Path) -> list[str] | None:
    """A command prefix under which `data` is read-only: chmod for a normal user; for root (who ignores
    permissions) a read-only bind mount in a private mount namespace. None: not possible here."""
    if os.geteuid() != 0:
        data.chmod(0o500)
        return []
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {data} {data} && "
                            f"mount -o remount,bind,ro {data} && ! touch {data}/probe"], capture_output=True)
    if probe.returncode != 0:
        return None
    return ["unshare", "-m", "sh", "-c", f'mount --bind {data} {data} && mount -o remount,bind,ro {data} && exec "$@"',
            "sh"]


def test_read_only_data_folder_refuses_to_start_with_a_reason(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    store = ChatStore(data / DB_NAME)
    chat = store.create_chat("kept")
    store.add_message(chat.id, "user", "saved before")
    store.close()
    before = (data / DB_NAME).read_bytes()
    wrap = read_only(data)
    if wrap is None:
        pytest.skip("cannot make a read-only folder here (root without mount namespaces)")
    try:
        done = run_app(data, wrap=wrap)
    finally:
        data.chmod(0o700)
    assert done.returncode == 4, done.stderr
    assert "not writable" in done.stderr and "--data-dir" in done.stderr and "Traceback" not in done.stderr
    assert (data / DB_NAME).read_bytes() == before
    store = ChatStore(data / DB_NAME)
    assert [m.content for m in store.messages(chat.id)] == ["saved before"]
    store.close()


def test_second_instance_on_the_same_data_is_refused(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    first = InstanceLock(data)
    assert first.acquire() is None  # this process stands for the running app
    try:
        done = run_app(data)
    finally:
        first.release()
    assert done.returncode == 3
    assert "already running" in done.stderr and "--data-dir" in done.stderr and "Traceback" not in done.stderr
