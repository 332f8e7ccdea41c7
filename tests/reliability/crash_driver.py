"""The real app (offscreen) on $TANDEM_DATA_DIR with the model $TANDEM_TEST_MODEL: it says which chat it
opened (OPENED <chat id> <messages>), sends one message once the model is loaded (SENT), and streams
the reply (STREAMING once text arrives). The crash test kills this process with SIGKILL at a random
moment after SENT, then starts it again on the same data."""

import os
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
    if lock.acquire() is not None:
        print("LOCKED", flush=True)
        return 3
    store = ChatStore(folder / DB_NAME)
    host = EngineHost()
    w = MainWindow(store, host, {"model": os.environ["TANDEM_TEST_MODEL"], "device": "cpu", "max_context": 1024})
    w.show()
    print(f"OPENED {w.conv.chat_id} {len(store.messages(w.conv.chat_id))} {store.recovered}", flush=True)
    text = sys.argv[1] if len(sys.argv) > 1 else "Tell me a long story."
    state = {"sent": False, "streaming": False}

    def on_state(s):
        if s == "failed":
            print("LOAD FAILED", flush=True)
            app.exit(1)
        if s == "ready" and not state["sent"]:
            state["sent"] = True
            w.apply_chat_settings({**store.chat(w.conv.chat_id).settings, "max_new_tokens": 600, "seed": None})
            w.composer.edit.setPlainText(text)
            w.conv.send()
            print("SENT", flush=True)

    def on_streamed(_text):
        if not state["streaming"]:
            state["streaming"] = True
            print("STREAMING", flush=True)

    host.state_changed.connect(on_state)
    w.conv.streamed.connect(on_streamed)
    w.conv.reply_finished.connect(lambda status, result: print(f"FINISHED {status}", flush=True))
    QTimer.singleShot(120_000, lambda: app.exit(2))  # never outlive a forgotten test run
    w.load_model()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
