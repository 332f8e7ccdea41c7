"""Persistence and exports: files that parse, a second instance refused, a kill -9 mid-reply survived."""

import csv
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from gui_helpers import send_and_wait, set_chat
from helpers import kill_hard
from PySide6.QtGui import QImage

from app.db import ChatStore
from app.main import main as app_main
from app.paths import DB_NAME, InstanceLock

ROOT = Path(__file__).resolve().parents[2]


def test_exports_are_written_and_parse(qtbot, open_window, tmp_path):
    w = open_window()
    set_chat(w, greedy=True, max_new_tokens=6, system_prompt="You are terse.")
    result = send_and_wait(qtbot, w, "What is 2+2?")
    qtbot.waitUntil(lambda: len(w.timeline) >= 2, timeout=5000)

    md = w.export_chat_markdown(tmp_path / "chat.md")[0].read_text()
    assert md.startswith("# What is 2+2?") and "You are terse." in md
    assert "## You\n\nWhat is 2+2?" in md and result["text"] in md and "tok/s" in md

    doc = json.loads(w.export_chat_json(tmp_path / "chat.json")[0].read_text())
    assert doc["format"] == "tandem-chat/1" and doc["model"] == "builtin:smollm2-135m-moe"
    assert [m["role"] for m in doc["messages"]] == ["user", "assistant"]
    assert doc["messages"][1]["stats"]["completion_tokens"] == result["completion_tokens"]

    js, cs = w.export_stats(tmp_path / "stats.json")
    timeline = json.loads(js.read_text())
    assert timeline["format"] == "tandem-stats-timeline/1"
    records = timeline["records"]
    assert len(records) == len(w.timeline) >= 2
    assert set(records[0]) >= {"phase", "vram", "host", "kv", "experts", "pcie", "speed", "kernels", "profile", "t"}
    assert [r["t"] for r in records] == sorted(r["t"] for r in records)
    with cs.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records)
    assert "vram.weights" in rows[0] and "kv.tokens.resident" in rows[0] and list(rows[0])[0] == "t"
    assert rows[-1]["vram.weights"] == ""  # null stays empty, never 0
    assert int(rows[-1]["host.rss"]) == records[-1]["host"]["rss"]

    png = w.export_panels_png(tmp_path / "panels.png")[0]
    img = QImage(str(png))
    assert not img.isNull() and img.width() > 100


def test_second_instance_is_refused(app_data, qtbot, capsys):
    first = InstanceLock(app_data)
    assert first.acquire() is None
    holder = InstanceLock(app_data).acquire()
    assert holder is not None and holder.pid == os.getpid()
    rc = app_main(["--data-dir", str(app_data)])
    assert rc == 3
    err = capsys.readouterr().err
    assert "already running" in err and f"process {os.getpid()}" in err
    first.release()
    assert InstanceLock(app_data).acquire() is None


def test_load_failure_is_explained_and_the_app_stays_usable(qtbot, open_window):
    w = open_window(engine=None)
    w.overrides["model"] = str(Path("no/such/model.gguf"))
    w.load_model()
    qtbot.waitUntil(lambda: w.host.state == "failed", timeout=60_000)
    qtbot.waitUntil(lambda: w.banner.isVisibleTo(w), timeout=5000)
    assert w.load_bar.format().startswith("reading model file")  # load progress reached the window
    text = w.banner_text.text()
    assert "could not be loaded" in text and "model.gguf" in text and "What to do" in text
    assert w.choose_btn.isVisibleTo(w) and w.retry_btn.isVisibleTo(w)
    # Still usable: chats can be made, settings changed; sending says why it cannot.
    first = w.conv.chat_id
    w.chat_list.rename(first, "First")  # an untouched "New chat" would be reused rather than added
    w.chat_list.new_chat()
    assert w.conv.chat_id != first and w.store.chat(w.conv.chat_id) is not None
    w.composer.edit.setPlainText("hello?")
    w.composer.send_btn.click()
    assert "No model is loaded" in w.statusBar().currentMessage()
    assert w.store.messages(w.conv.chat_id) == []


def test_kill_9_mid_reply_keeps_the_database_consistent(tmp_path):
    data = tmp_path / "data"
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "TANDEM_DATA_DIR": str(data),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("drive_app.py"))], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []

    def until_streaming():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.startswith("STREAMING"):
                break
        assert lines and lines[-1].startswith("STREAMING"), (lines, proc.stderr.read() if proc.poll() else "")

    kill_hard(proc, until_streaming)
    first_reply = json.loads(lines[-2].removeprefix("FIRST "))

    conn = sqlite3.connect(data / DB_NAME)  # as the next start opens it, WAL and all
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = conn.execute("SELECT role, content, status FROM messages ORDER BY id").fetchall()
    conn.close()
    assert rows[0] == ("user", "What is the capital of France?", "done")
    assert rows[1] == ("assistant", first_reply["text"], "done")  # the earlier reply, intact
    assert rows[2][:2] == ("user", "Tell me a long story about a lighthouse keeper.")
    assert rows[3][0] == "assistant" and rows[3][2] == "streaming" and len(rows[3][1]) > 0  # text so far

    store = ChatStore(data / DB_NAME)  # the next start marks the cut-off reply, keeping its text
    assert store.recovered == 1
    msgs = store.messages(store.chats()[0].id)
    assert msgs[3].status == "interrupted" and msgs[3].content == rows[3][1]
    store.close()
    assert InstanceLock(data).acquire() is None  # the dead process's lock is stale and taken over
