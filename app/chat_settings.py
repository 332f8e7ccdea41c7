"""Per-chat settings: system prompt, sampling, reply length and the context overflow policy."""

from __future__ import annotations

from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFormLayout,
                               QPlainTextEdit, QSpinBox, QVBoxLayout)

from app.context import POLICIES
from app.db import DEFAULT_CHAT_SETTINGS

SAMPLING_KEYS = ("max_new_tokens", "greedy", "temperature", "top_k", "top_p", "repetition_penalty", "seed")


def request_fields(settings: dict) -> dict:
    """The GenerationRequest fields a chat's settings set."""
    return {k: settings.get(k, DEFAULT_CHAT_SETTINGS[k]) for k in SAMPLING_KEYS}


class ChatSettingsDialog(QDialog):
    def __init__(self, settings: dict, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Chat settings")
        s = {**DEFAULT_CHAT_SETTINGS, **settings}
        form = QFormLayout()
        self.system = QPlainTextEdit(s["system_prompt"])
        self.system.setPlaceholderText("Optional: instructions the model sees before the chat (its tokens count "
                                       "against the context)")
        form.addRow("System prompt", self.system)
        self.max_new = QSpinBox()
        self.max_new.setRange(1, 32768)
        self.max_new.setValue(int(s["max_new_tokens"]))
        form.addRow("Reply length (max tokens)", self.max_new)
        self.greedy = QCheckBox("Greedy (always the most likely token; the settings below are ignored)")
        self.greedy.setChecked(bool(s["greedy"]))
        form.addRow("", self.greedy)
        self.temperature = self._dspin(0.0, 2.0, 0.05, s["temperature"])
        form.addRow("Temperature", self.temperature)
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 1000)
        self.top_k.setSpecialValueText("off")
        self.top_k.setValue(int(s["top_k"]))
        form.addRow("Top-k", self.top_k)
        self.top_p = self._dspin(0.01, 1.0, 0.01, s["top_p"])
        form.addRow("Top-p", self.top_p)
        self.rep = self._dspin(1.0, 2.0, 0.01, s["repetition_penalty"])
        form.addRow("Repetition penalty", self.rep)
        self.seed = QSpinBox()
        self.seed.setRange(-1, 2**31 - 1)
        self.seed.setSpecialValueText("random")
        self.seed.setValue(-1 if s["seed"] is None else int(s["seed"]))
        form.addRow("Seed", self.seed)
        self.overflow = QComboBox()
        for key, text in POLICIES.items():
            self.overflow.addItem(text, key)
        self.overflow.setCurrentIndex(max(0, self.overflow.findData(s["overflow"])))
        form.addRow("When the chat outgrows the context", self.overflow)
        self.as_default = QCheckBox("Use these settings for new chats")
        form.addRow("", self.as_default)
        self.greedy.toggled.connect(self._sync)
        self._sync()
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(buttons)

    def _dspin(self, lo, hi, step, value) -> QDoubleSpinBox:
        d = QDoubleSpinBox()
        d.setRange(lo, hi)
        d.setSingleStep(step)
        d.setDecimals(2)
        d.setValue(float(value))
        return d

    def _sync(self) -> None:
        for w in (self.temperature, self.top_k, self.top_p, self.seed):
            w.setEnabled(not self.greedy.isChecked())

    def values(self) -> dict:
        return {"system_prompt": self.system.toPlainText(), "max_new_tokens": self.max_new.value(),
                "greedy": self.greedy.isChecked(), "temperature": self.temperature.value(),
                "top_k": self.top_k.value(), "top_p": self.top_p.value(), "repetition_penalty": self.rep.value(),
                "seed": None if self.seed.value() < 0 else self.seed.value(),
                "overflow": self.overflow.currentData()}
