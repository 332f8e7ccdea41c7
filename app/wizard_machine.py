"""The wizard's first two pages: the machine in words, and calibration as one bar and one line.

Everything shown is what the engine reports through `engine.api` (`probe_hardware()`,
`calibrate(mode, progress)`, `load_profile()`); app/hardware_words.py puts it in words and the exact
record stays one click away under Details. Calibration runs on a background thread; cancel raises
from its progress callback, so the engine stops at its next report and the profile in use stays.
"""

from __future__ import annotations

import json

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QCheckBox, QGridLayout, QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout,
                               QWizardPage)

from app.hardware_words import machine_rows, no_gpu_reason, profile_line
from app.wizard_common import Details, Task, engine_api, facts_html, gather_facts


def _label(text: str = "", name: str | None = None) -> QLabel:
    lab = QLabel(text)
    lab.setWordWrap(True)
    lab.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    if name:
        lab.setObjectName(name)
    return lab


class HardwarePage(QWizardPage):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setTitle("This computer")
        self.setSubTitle("What Tandem found. The engine plans around it when a model loads.")
        lay = QVBoxLayout(self)
        lay.setSpacing(10)
        self.text = _label("Looking at this machine…")
        lay.addWidget(self.text)
        self.grid = QGridLayout()
        self.grid.setHorizontalSpacing(16)
        self.grid.setVerticalSpacing(6)
        lay.addLayout(self.grid)
        self.rows: dict[str, QLabel] = {}
        self.note = _label(name="hardwareNote")
        self.note.hide()
        lay.addWidget(self.note)
        self.details = Details("Details: everything the probe reported")
        self.details.hide()
        lay.addWidget(self.details)
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
            return
        probe = facts["probe"]
        self.text.hide()
        for i, (label, words) in enumerate(machine_rows(probe)):
            if label not in self.rows:
                head = QLabel(label)
                head.setObjectName("factLabel")
                self.grid.addWidget(head, i, 0, Qt.AlignmentFlag.AlignTop)
                self.rows[label] = _label(name="factValue")
                self.grid.addWidget(self.rows[label], i, 1)
            self.rows[label].setText(words)
        self.grid.setColumnStretch(1, 1)
        why = no_gpu_reason(probe)
        self.note.setText(why or "")
        self.note.setVisible(why is not None)
        self.details.set_html(facts_html(probe))
        self.details.show()

    def isComplete(self) -> bool:
        return self.wizard().facts is not None


class CalibrationPage(QWizardPage):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setTitle("Calibration")
        self.setSubTitle("Tandem measures how fast this machine moves and computes data, to split the work "
                         "between GPU and CPU well. The quick run takes under a minute.")
        lay = QVBoxLayout(self)
        lay.setSpacing(10)
        self.current = _label(name="calibrationResult")  # the one-line result, or "Not calibrated yet"
        lay.addWidget(self.current)
        row = QHBoxLayout()
        self.run_btn = QPushButton("Run quick calibration")
        self.run_btn.clicked.connect(self.start)
        self.cancel_btn = QPushButton("Stop")
        self.cancel_btn.setToolTip("Stop measuring; the profile in use stays as it is")
        self.cancel_btn.setEnabled(False)
        self.cancel_btn.clicked.connect(self.cancel)
        row.addWidget(self.run_btn)
        row.addWidget(self.cancel_btn)
        row.addStretch(1)
        lay.addLayout(row)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.setTextVisible(False)
        lay.addWidget(self.bar)
        self.step = _label(name="calibrationStep")
        lay.addWidget(self.step)
        self.skip = QCheckBox("Skip for now (calibrate later from Settings)")
        self.skip.toggled.connect(self.completeChanged)
        lay.addWidget(self.skip)
        self.details = Details("Details: the measured profile")
        self.details.hide()
        lay.addWidget(self.details)
        lay.addStretch(1)
        self.task = None
        self.running = False
        self.result: dict | None = None

    def profile(self) -> dict | None:
        """The profile the engine would use now: this run's, else the valid one already saved."""
        return self.result or (self.wizard().facts or {}).get("profile")

    def initializePage(self) -> None:
        facts = self.wizard().facts or {}
        if not facts.get("has_calibrate"):
            self.current.setText("This engine build has no calibration (engine.api.calibrate); the engine uses "
                                 "its defaults.")
            self.run_btn.setEnabled(False)
            self.skip.setChecked(True)
            return
        self._show_profile(self.profile())

    def _show_profile(self, profile: dict | None) -> None:
        self.current.setText(f"<b>{profile_line(profile)}</b>" if profile else
                             "Not calibrated yet. Without a profile the engine uses safe defaults.")
        self.run_btn.setText("Calibrate again" if profile else "Run quick calibration")
        self.skip.setVisible(profile is None)  # with a valid profile there is nothing to skip
        self.details.setVisible(profile is not None)
        if profile is not None:
            self.details.set_html(facts_html(profile))
        self.completeChanged.emit()

    def start(self) -> None:
        calibrate = engine_api("calibrate")
        self.task = Task(lambda progress: calibrate(mode="quick", progress=progress), self)
        self.task.progress.connect(self._progress)
        self.task.done.connect(self._done)
        self.task.failed.connect(self._failed)
        self.run_btn.setEnabled(False)
        self.cancel_btn.setEnabled(True)
        self.bar.setValue(0)
        self.step.setText("Starting…")
        self.running = True  # until the task's done/failed signal has been handled here
        self.completeChanged.emit()
        self.task.start()

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancelled = True
            self.step.setText("Stopping at the next measurement…")

    def _progress(self, step: str, frac: float) -> None:
        frac = max(0.0, min(1.0, frac))
        self.bar.setValue(int(1000 * frac))
        self.step.setText(f"{100 * frac:.0f}% · {step}" if step else f"{100 * frac:.0f}%")

    def _done(self, profile) -> None:
        self.result = profile if isinstance(profile, dict) else {"profile": json.dumps(profile, default=str)}
        self.wizard().facts["profile"] = self.result
        self.bar.setValue(1000)
        self.step.setText("Done: the new profile is saved and in use.")
        self._idle()
        self._show_profile(self.result)

    def _failed(self, what: str, remedy: str) -> None:
        self.step.setText("Stopped; the previous profile stays in use." if what == "cancelled"
                          else f"Calibration failed: {what} {remedy}".strip())
        self.bar.setValue(0)
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
        return not self.busy() and (self.profile() is not None or self.skip.isChecked())
