"""A reply's reasoning (a reasoning model's thinking, gpt-oss's analysis channel) shown apart from
its answer: a dimmed block above it, folded to one line so the answer stays what one reads, opened
with a click."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QToolButton, QVBoxLayout, QWidget


class ReasoningBlock(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("reasoningBlock")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 4)
        lay.setSpacing(2)
        self.toggle = QToolButton()
        self.toggle.setObjectName("reasoningToggle")
        self.toggle.setCheckable(True)
        self.toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.toggle.setToolTip("The model's reasoning before its answer (not sent back to the model)")
        self.toggle.toggled.connect(self._set_open)
        # plain text: reasoning is a draft, often half-formed Markdown that would render as noise
        self.text = QLabel()
        self.text.setObjectName("reasoningText")
        self.text.setWordWrap(True)
        self.text.setTextFormat(Qt.TextFormat.PlainText)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        lay.addWidget(self.toggle)
        lay.addWidget(self.text)
        self.thinking = False
        self.set_reasoning("")

    @property
    def is_open(self) -> bool:
        return self.toggle.isChecked()

    def set_reasoning(self, reasoning: str, thinking: bool = False) -> None:
        """`thinking`: the reply is still in its reasoning (no answer yet), said on the folded line."""
        self.thinking = thinking
        self.text.setText(reasoning.strip())
        self.setVisible(bool(reasoning.strip()))
        self._label()

    def _set_open(self, open_: bool) -> None:
        self.text.setVisible(open_)
        self._label()

    def _label(self) -> None:
        self.toggle.setArrowType(Qt.ArrowType.DownArrow if self.is_open else Qt.ArrowType.RightArrow)
        words = len(self.text.text().split())
        self.toggle.setText("Thinking…" if self.thinking else f"Reasoning ({words:,} word{'s' if words != 1 else ''})")
        self.text.setVisible(self.is_open)
