"""Runs the real app (offscreen) through one finished exchange, then starts a long reply and says
STREAMING once part of it is in the database — the kill -9 test kills this process right then."""

import json
import sys

from PySide6.QtCore import QTimer

from app.db import ChatStore
from app.main import make_application
from app.main_window import MainWindow
from app.paths import DB_NAME, InstanceLock, data_dir
from app.engine_host import EngineHost


def main() -> int:
    app = make_application([])
    folder = data_dir()
    lock = InstanceLock(folder)
    assert lock.acquire() is None
    store = ChatStore(folder / DB_NAME)
    host = EngineHost()
    w = MainWindow(store, host, {"model": "builtin:smollm2-135m-moe", "device": "cpu"})
    w.show()
    state = {"stage": "load"}

    def settings(**kw):
        w.apply_chat_settings({**store.chat(w.conv.chat_id).settings, **kw})

    def on_state(s):
        if s == "failed":
            print("LOAD FAILED", flush=True)
            app.exit(1)
        if s == "ready" and state["stage"] == "load":
            state["stage"] = "first"
            settings(greedy=True, max_new_tokens=8)
            w.composer.edit.setPlainText("What is the capital of France?")
            w.conv.send()

    def on_finished(status, result):
        if state["stage"] == "first":
            print("FIRST " + json.dumps(result), flush=True)
            state["stage"] = "story"
            settings(greedy=False, temperature=0.8, seed=3, max_new_tokens=2000)
            w.composer.edit.setPlainText("Tell me a long story about a lighthouse keeper.")
            w.conv.send()

    def on_streamed(_text):
        if state["stage"] != "story":
            return
        row = store.conn.execute("SELECT length(content) FROM messages WHERE status='streaming'").fetchone()
        if row and row[0] > 0:
            state["stage"] = "killable"
            print(f"STREAMING {row[0]}", flush=True)

    host.state_changed.connect(on_state)
    w.conv.reply_finished.connect(on_finished)
    w.conv.streamed.connect(on_streamed)
    QTimer.singleShot(600_000, lambda: app.exit(2))  # never outlive a forgotten test run
    w.load_model()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
