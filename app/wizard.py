"""First-run wizard (and Settings → re-run): hardware found, calibration, model and memory, done.

Everything shown about the machine is what the engine reports through `engine.api`:
`probe_hardware()`, `calibrate(mode, progress, profile_path)` and `load_profile(path)`. An engine
build without one of them gets a page that says so; nothing is guessed on the app side.
Calibration runs on a background thread; cancel raises from its progress callback, so the engine
stops at its next report and the profile in use stays as it was.
"""

from __future__ import annotations

import json

from PySide6.QtCore import QThread, Signal
from PySide6.QtWidgets import (QButtonGroup, QCheckBox, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout,
                               QLabel, QLineEdit, QProgressBar, QPushButton, QRadioButton, QSpinBox, QVBoxLayout,
                               QWizard, QWizardPage)

HARDWARE, CALIBRATION, MODEL, DONE = range(4)


class Cancelled(Exception):
    pass


class Task(QThread):
    """Runs fn(progress) off the GUI thread; progress(step, fraction) is forwarded as a signal."""

    progress = Signal(str, float)
    done = Signal(object)
    failed = Signal(str, str)

    def __init__(self, fn, parent=None):
        super().__init__(parent)
        self.fn = fn
        self.cancelled = False

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


class HardwarePage(QWizardPage):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setTitle("Hardware found")
        self.setSubTitle("What the engine sees on this machine.")
        lay = QVBoxLayout(self)
        self.text = QLabel("Looking at this machine…")
        self.text.setWordWrap(True)
        lay.addWidget(self.text)
        lay.addStretch(1)
        self.task = None

    def initializePage(self) -> None:
        if self.wizard().facts is not None:
            self._show(self.wizard().facts)
            return
        self.task = Task(gather_facts, self)
        self.task.done.connect(self._loaded)
        self.task.failed.connect(self._failed)
        self.task.start()

    def _failed(self, what: str, remedy: str) -> None:
        self.text.setText(f"The hardware probe failed: {what} {remedy}")

    def _loaded(self, facts: dict) -> None:
        self.wizard().facts = facts
        self._show(facts)
        self.completeChanged.emit()

    def _show(self, facts: dict) -> None:
        if not facts["has_probe"]:
            self.text.setText("This engine build has no hardware probe (engine.api.probe_hardware). The engine "
                              "still picks the device itself when the model loads.")
        else:
            self.text.setText(facts_html(facts["probe"]))

    def isComplete(self) -> bool:
        return self.wizard().facts is not None


class CalibrationPage(QWizardPage):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setTitle("Calibration")
        self.setSubTitle("Measure this machine's transfer and compute speeds (quick mode: under a minute). "
                         "The profile in use is kept until a new one completes.")
        lay = QVBoxLayout(self)
        self.current = QLabel()
        self.current.setWordWrap(True)
        lay.addWidget(self.current)
        row = QHBoxLayout()
        self.run_btn = QPushButton("Run quick calibration")
        self.run_btn.clicked.connect(self.start)
        self.cancel_btn = QPushButton("Cancel")
        self.cancel_btn.setEnabled(False)
        self.cancel_btn.clicked.connect(self.cancel)
        row.addWidget(self.run_btn)
        row.addWidget(self.cancel_btn)
        row.addStretch(1)
        lay.addLayout(row)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        lay.addWidget(self.bar)
        self.step = QLabel()
        self.step.setWordWrap(True)
        lay.addWidget(self.step)
        self.skip = QCheckBox("Skip for now (calibrate later from Settings)")
        self.skip.toggled.connect(self.completeChanged)
        lay.addWidget(self.skip)
        lay.addStretch(1)
        self.task = None
        self.running = False
        self.result: dict | None = None

    def initializePage(self) -> None:
        facts = self.wizard().facts or {}
        if not facts.get("has_calibrate"):
            self.current.setText("This engine build has no calibration (engine.api.calibrate); the engine uses "
                                 "its defaults.")
            self.run_btn.setEnabled(False)
            self.skip.setChecked(True)
            return
        profile = self.result or facts.get("profile")
        self.current.setText("Profile in use:<br>" + facts_html(profile) if profile else
                             "No calibration profile yet.")

    def start(self) -> None:
        calibrate = engine_api("calibrate")
        self.task = Task(lambda progress: calibrate(mode="quick", progress=progress), self)
        self.task.progress.connect(self._progress)
        self.task.done.connect(self._done)
        self.task.failed.connect(self._failed)
        self.run_btn.setEnabled(False)
        self.cancel_btn.setEnabled(True)
        self.bar.setValue(0)
        self.step.setText("starting…")
        self.running = True  # until the task's done/failed signal has been handled here
        self.task.start()

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancelled = True
            self.step.setText("cancelling at the next measurement…")

    def _progress(self, step: str, frac: float) -> None:
        self.bar.setValue(int(1000 * max(0.0, min(1.0, frac))))
        self.step.setText(step)

    def _done(self, profile) -> None:
        self.result = profile if isinstance(profile, dict) else {"profile": json.dumps(profile, default=str)}
        self.wizard().facts["profile"] = self.result
        self.bar.setValue(1000)
        self.step.setText("Calibration complete; the new profile is in use.")
        self.current.setText("Profile in use:<br>" + facts_html(self.result))
        self._idle()

    def _failed(self, what: str, remedy: str) -> None:
        self.step.setText("Cancelled; the previous profile stays in use." if what == "cancelled"
                          else f"Calibration failed: {what} {remedy}".strip())
        self._idle()

    def _idle(self) -> None:
        self.running = False
        self.run_btn.setEnabled(True)
        self.cancel_btn.setEnabled(False)
        self.completeChanged.emit()

    def busy(self) -> bool:
        # Not the thread's own state: it ends before its last queued signal reaches this page.
        return self.running

    def isComplete(self) -> bool:
        return not self.busy() and (self.result is not None or self.skip.isChecked())


class ModelPage(QWizardPage):
    def __init__(self, current: dict, parent=None):
        super().__init__(parent)
        self.setTitle("Model and memory")
        self.setSubTitle("Which model to load, and how much memory it may use.")
        self.current = current
        self.lay = QVBoxLayout(self)
        self.group = QButtonGroup(self)
        self.builtin_box = QVBoxLayout()
        self.lay.addLayout(self.builtin_box)
        self.local_radio = QRadioButton("A local model: a .gguf file or a Hugging Face folder (config.json + "
                                        "*.safetensors)")
        self.group.addButton(self.local_radio)
        self.lay.addWidget(self.local_radio)
        row = QHBoxLayout()
        self.path = QLineEdit()
        self.path.setPlaceholderText("path to model.gguf or a model folder")
        self.path.textChanged.connect(self._path_changed)
        file_btn, dir_btn = QPushButton("File…"), QPushButton("Folder…")
        file_btn.clicked.connect(lambda: self._pick(QFileDialog.getOpenFileName(
            self, "GGUF model", "", "GGUF (*.gguf)")[0]))
        dir_btn.clicked.connect(lambda: self._pick(QFileDialog.getExistingDirectory(self, "Model folder")))
        row.addWidget(self.path, 1)
        row.addWidget(file_btn)
        row.addWidget(dir_btn)
        self.lay.addLayout(row)
        self._remote_fields(current)
        form = QFormLayout()
        self.vram = QDoubleSpinBox()
        self.vram.setRange(0.0, 4096.0)
        self.vram.setDecimals(1)
        self.vram.setSpecialValueText("engine decides")
        self.vram.setSuffix(" GB")
        self.vram.setValue(float(current.get("vram_budget_gb") or 0.0))
        form.addRow("GPU memory budget", self.vram)
        self.ctx = QSpinBox()
        self.ctx.setRange(0, 1 << 20)
        self.ctx.setSingleStep(1024)
        self.ctx.setSpecialValueText("the model's own")
        self.ctx.setValue(int(current.get("max_context") or 0))
        form.addRow("Context window (tokens)", self.ctx)
        self.threads = QSpinBox()
        self.threads.setRange(0, 1024)
        self.threads.setSpecialValueText("automatic")
        self.threads.setValue(int(current.get("cpu_threads") or 0))
        form.addRow("CPU threads", self.threads)
        self.lay.addLayout(form)
        self.note = QLabel()
        self.note.setWordWrap(True)
        self.lay.addWidget(self.note)
        self.lay.addStretch(1)
        self.radios: dict[str, QRadioButton] = {}
        self.group.buttonToggled.connect(lambda *_: self.completeChanged.emit())

    def _remote_fields(self, current: dict) -> None:
        """A model on another machine: any OpenAI-compatible server (another Tandem, llama.cpp, vLLM…)."""
        self.remote_radio = QRadioButton("A remote server (OpenAI-compatible: another Tandem, llama.cpp, vLLM, …)")
        self.group.addButton(self.remote_radio)
        self.lay.addWidget(self.remote_radio)
        remote = QFormLayout()
        self.remote_url = QLineEdit(current.get("remote_url") or "")
        self.remote_url.setPlaceholderText("http://192.168.1.20:8000/v1")
        self.remote_key = QLineEdit(current.get("remote_api_key") or "")
        self.remote_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.remote_key.setPlaceholderText("its API key (kept in a file only you can read)")
        self.remote_model = QLineEdit(current.get("model") if current.get("backend") == "remote" else "")
        self.remote_model.setPlaceholderText("model id (empty: the server's first model)")
        remote.addRow("Address", self.remote_url)
        remote.addRow("API key", self.remote_key)
        remote.addRow("Model", self.remote_model)
        self.lay.addLayout(remote)
        for w in (self.remote_url, self.remote_key, self.remote_model):
            w.textEdited.connect(lambda _t: (self.remote_radio.setChecked(True), self.completeChanged.emit()))

    def remote(self) -> bool:
        return self.remote_radio.isChecked()

    def _path_changed(self, text: str) -> None:
        if text:
            self.local_radio.setChecked(True)
        self.completeChanged.emit()

    def initializePage(self) -> None:
        facts = self.wizard().facts or {}
        if not self.radios:
            for m in facts.get("models", []):
                rb = QRadioButton(f"{m['name']}{'  (default)' if m['default'] else ''}\n{m['description']}")
                self.group.addButton(rb)
                self.builtin_box.addWidget(rb)
                self.radios[m["name"]] = rb
        model = self.current.get("model")
        if self.current.get("backend") == "remote":
            self.remote_radio.setChecked(True)
        elif model in self.radios:
            self.radios[model].setChecked(True)
        elif model:
            self.path.setText(model)
        elif self.radios:
            next(iter(self.radios.values())).setChecked(True)
        gpu = (facts.get("probe") or {}).get("gpu") if facts.get("has_probe") else None
        self.vram.setEnabled(gpu is not None or not facts.get("has_probe"))
        self.note.setText("" if gpu is not None or not facts.get("has_probe") else
                          "No GPU was found: the model runs on the CPU and the GPU budget does not apply.")

    def _pick(self, path: str) -> None:
        if path:
            self.path.setText(path)

    def model(self) -> str:
        if self.remote():
            return self.remote_model.text().strip() or "auto"
        for name, rb in self.radios.items():
            if rb.isChecked():
                return name
        return self.path.text().strip()

    def isComplete(self) -> bool:
        if self.remote():
            return self.remote_url.text().strip().startswith(("http://", "https://"))
        return bool(self.model())

    def values(self) -> dict:
        v = {"model": self.model(), "vram_budget_gb": self.vram.value() or None,
             "max_context": self.ctx.value() or None, "cpu_threads": self.threads.value() or None}
        if self.remote():  # the key goes to an owner-only file, not the settings database (main_window)
            v.update(backend="remote", remote_url=self.remote_url.text().strip(),
                     remote_api_key=self.remote_key.text().strip())
        return v


class DonePage(QWizardPage):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setTitle("Ready")
        lay = QVBoxLayout(self)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)
        lay.addStretch(1)

    def initializePage(self) -> None:
        v = {k: val for k, val in self.wizard().values().items() if k != "remote_api_key"}  # never on screen
        self.summary.setText("The app loads this model and opens a chat:<br>" + facts_html(v) +
                             "<br>Everything here can be changed later under Settings.")


class SetupWizard(QWizard):
    def __init__(self, current: dict | None = None, start: int = HARDWARE, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Tandem setup")
        self.setWizardStyle(QWizard.WizardStyle.ModernStyle)
        self.facts: dict | None = None
        self.setPage(HARDWARE, HardwarePage())
        self.calibration = CalibrationPage()
        self.setPage(CALIBRATION, self.calibration)
        self.model_page = ModelPage(current or {})
        self.setPage(MODEL, self.model_page)
        self.setPage(DONE, DonePage())
        self.setStartId(start)
        if start != HARDWARE:  # pages after the first still need the engine's facts
            self.facts = gather_facts(None)
        self.setButtonText(QWizard.WizardButton.FinishButton, "Start chatting")
        self.resize(720, 560)

    def values(self) -> dict:
        return self.model_page.values()

    def reject(self) -> None:
        if self.calibration.busy():
            self.calibration.cancel()
            self.calibration.task.wait()
        super().reject()
