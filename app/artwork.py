"""The README's pictures, from a real run: `python -m app.artwork screenshots DIR` (run it under an X
server such as Xvfb: `xvfb-run -s "-screen 0 1600x1000x24" python -m app.artwork screenshots DIR`)
and the icon PNGs drawn from assets/tandem.svg: `python -m app.artwork icons DIR`.

The screenshots use a throwaway data dir, load the built-in MoE model, have one real exchange, then
start a second reply and grab the window while it streams, panels and all.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from app.main import ASSETS

ICON_SIZES = (16, 32, 48, 64, 128, 256, 512)


def render_icons(out: Path) -> list[Path]:
    import os

    if not os.environ.get("DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # icons need no screen
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    _app = QGuiApplication.instance() or QGuiApplication([])
    renderer = QSvgRenderer(str(ASSETS / "tandem.svg"))
    written = []
    for n in ICON_SIZES:
        img = QImage(n, n, QImage.Format.Format_ARGB32)
        img.fill(Qt.GlobalColor.transparent)
        p = QPainter(img)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        renderer.render(p)
        p.end()
        path = out / f"tandem-{n}.png"
        img.save(str(path))
        written.append(path)
    return written


def take_screenshots(out: Path) -> list[Path]:
    import os

    os.environ["TANDEM_DATA_DIR"] = tempfile.mkdtemp(prefix="tandem-shots-")
    from PySide6.QtCore import QTimer

    from app.db import ChatStore
    from app.main import make_application
    from app.main_window import MainWindow
    from app.paths import DB_NAME, data_dir
    from app.wizard import HARDWARE, MODEL, SetupWizard
    from app.worker import EngineHost

    app = make_application([])
    written: list[Path] = []

    def grab(widget, name):
        path = out / name
        widget.grab().save(str(path))
        written.append(path)

    wiz = SetupWizard({"model": "builtin:smollm2-135m-moe"}, HARDWARE)
    wiz.show()
    while wiz.facts is None:
        app.processEvents()
    app.processEvents()
    grab(wiz, "wizard-hardware.png")
    wiz.next()
    wiz.next()
    assert wiz.currentId() == MODEL
    app.processEvents()
    grab(wiz, "wizard-model.png")
    wiz.close()

    store = ChatStore(data_dir() / DB_NAME)
    host = EngineHost()
    w = MainWindow(store, host)
    w.resize(1480, 900)
    w.show()
    stage = {"now": "load"}

    def settings(**kw):
        w.apply_chat_settings({**store.chat(w.conv.chat_id).settings, **kw})

    def on_state(s):
        if s == "ready" and stage["now"] == "load":
            stage["now"] = "first"
            settings(greedy=True, max_new_tokens=120, system_prompt="You are a helpful assistant.")
            w.composer.edit.setPlainText("Write a Python function that reverses a string.")
            w.conv.send()
        elif s == "failed":
            app.exit(1)

    def on_finished(status, result):
        if stage["now"] == "first":
            stage["now"] = "second"
            settings(greedy=False, temperature=0.7, seed=7, max_new_tokens=300)
            w.composer.edit.setPlainText("Now explain how it works, step by step.")
            w.conv.send()
        elif stage["now"] == "done":
            app.exit(0)

    def on_streamed(_text):
        if stage["now"] == "second" and w.conv.job and len(w.conv.job.text) > 220:
            stage["now"] = "done"
            grab(w, "main-window-mid-reply.png")
            w.conv.stop()

    host.state_changed.connect(on_state)
    w.conv.reply_finished.connect(on_finished)
    w.conv.streamed.connect(on_streamed)
    QTimer.singleShot(900_000, lambda: app.exit(2))
    w.load_model()
    rc = app.exec()
    w.close()
    store.close()
    if rc != 0:
        raise SystemExit(f"screenshots failed (rc {rc})")
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("screenshots", "icons"):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    paths = render_icons(out) if argv[0] == "icons" else take_screenshots(out)
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
