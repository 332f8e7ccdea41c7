"""What the wizard's pages share: the background task, the engine's facts, the Details expander."""

from __future__ import annotations

from PySide6.QtCore import QThread, Qt, Signal
from PySide6.QtWidgets import QSizePolicy, QTextBrowser, QToolButton, QVBoxLayout, QWidget

DETAILS_MAX_HEIGHT = 190  # an opened Details box scrolls inside itself: every page still fits 1280×720


class Cancelled(Exception):
    pass


class Task(QThread):
    """Runs fn(progress) off the GUI thread; progress(step, fraction) is forwarded as a signal."""

    progress = Signal(str, float)
    done = Signal(object)
    failed = Signal(str, str)

    RUNNING: set = set()  # a running task outlives its page: Qt aborts the process if a live thread is deleted

    def __init__(self, fn, parent=None):
        super().__init__(None)  # no parent, for the same reason; `parent` is kept as a plain reference
        self.owner = parent
        self.fn = fn
        self.cancelled = False

    def start(self, *args) -> None:
        # Forget the tasks that have ended (here, on the GUI thread: a thread must not drop itself).
        Task.RUNNING.difference_update([t for t in Task.RUNNING if t.isFinished()])
        Task.RUNNING.add(self)
        super().start(*args)

    def report(self, *args) -> None:
        if self.cancelled:
            raise Cancelled()
        step = next((a for a in args if isinstance(a, str)), "")
        frac = next((float(a) for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)), 0.0)
        self.progress.emit(step, frac)

    def run(self) -> None:
        try:
            self.done.emit(self.fn(self.report))
        except Cancelled:
            self.failed.emit("cancelled", "")
        except Exception as e:  # noqa: BLE001 — shown on the page; the wizard stays usable
            self.failed.emit(getattr(e, "what", f"{type(e).__name__}: {e}"), getattr(e, "remedy", ""))


def engine_api(name: str):
    """A function of engine.api, or None when this engine build lacks it."""
    import engine.api

    return getattr(engine.api, name, None)


def gather_facts(_progress) -> dict:
    probe, profile, builtins = engine_api("probe_hardware"), engine_api("load_profile"), engine_api("builtin_models")
    return {"probe": probe() if probe else None, "has_probe": probe is not None,
            "profile": profile() if profile else None, "has_calibrate": engine_api("calibrate") is not None,
            "models": builtins() if builtins else []}


def facts_html(d: dict | None, prefix: str = "") -> str:
    """A JSON-able dict as rows of an HTML table (nested keys dotted), exactly as reported."""
    rows = []

    def walk(v, key):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{key}.{k}" if key else str(k))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                walk(x, f"{key}[{i}]")
        else:
            text = "n/a" if v is None else (", ".join(map(str, v)) if isinstance(v, list) else str(v))
            rows.append(f"<tr><td><b>{key}</b></td><td>{text}</td></tr>")

    walk(d or {}, prefix)
    return "<table cellspacing=4>" + "".join(rows) + "</table>"


class Details(QWidget):
    """A "Details" button that opens the exact record below it, in a box that scrolls by itself."""

    def __init__(self, title: str = "Details", parent=None):
        super().__init__(parent)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        self.toggle = QToolButton()
        self.toggle.setObjectName("detailsToggle")
        self.toggle.setText(title)
        self.toggle.setCheckable(True)
        self.toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.toggle.setAutoRaise(True)
        self.toggle.toggled.connect(self._toggled)
        lay.addWidget(self.toggle)
        self.body = QTextBrowser()
        self.body.setObjectName("detailsBody")
        self.body.setOpenLinks(False)
        self.body.setMaximumHeight(DETAILS_MAX_HEIGHT)
        self.body.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Maximum)
        self.body.hide()
        lay.addWidget(self.body)

    def set_html(self, html: str) -> None:
        self.body.setHtml(html)

    def html(self) -> str:
        return self.body.toHtml()

    def _toggled(self, on: bool) -> None:
        self.toggle.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)
        self.body.setVisible(on)
