"""The input area: message box, attached files with their token counts, the context gauge, send/stop."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (QFileDialog, QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QProgressBar, QPushButton,
                               QToolButton, QVBoxLayout, QWidget)

from app.context import Attachment, ContextPlan


PLACEHOLDER = "Message — Enter sends, Shift+Enter starts a new line"


class MessageEdit(QPlainTextEdit):
    """Enter sends, Shift+Enter breaks the line; pasted or dropped files become attachments."""

    submit = Signal()
    files_pasted = Signal(list)  # local paths

    def keyPressEvent(self, e: QKeyEvent) -> None:
        if e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not e.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submit.emit()
            return
        super().keyPressEvent(e)

    def canInsertFromMimeData(self, source) -> bool:
        return source.hasUrls() or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source) -> None:
        paths = [u.toLocalFile() for u in source.urls() if u.isLocalFile()] if source.hasUrls() else []
        if paths:
            self.files_pasted.emit(paths)
        else:
            super().insertFromMimeData(source)


class AttachmentChip(QFrame):
    removed = Signal(object)

    def __init__(self, attachment: Attachment, parent=None):
        super().__init__(parent)
        self.attachment = attachment
        self.setObjectName("attachmentChip")
        lay = QHBoxLayout(self)
        lay.setContentsMargins(6, 2, 2, 2)
        self.label = QLabel()
        lay.addWidget(self.label)
        x = QToolButton()
        x.setText("✕")
        x.setToolTip(f"Remove {attachment.name}")
        x.clicked.connect(lambda: self.removed.emit(self.attachment))
        lay.addWidget(x)
        self.refresh()

    def refresh(self) -> None:
        a = self.attachment
        n = "counting…" if a.tokens is None else f"{a.tokens:,} tokens"
        self.label.setText(f"{a.name} — {n}")


class Composer(QWidget):
    send_requested = Signal()
    stop_requested = Signal()
    files_chosen = Signal(list)
    changed = Signal()  # the draft or its attachments changed: recount

    def __init__(self, parent=None):
        super().__init__(parent)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        self.chips_row = QHBoxLayout()
        self.chips_row.addStretch(1)
        lay.addLayout(self.chips_row)
        self.edit = MessageEdit()
        # Short enough for the narrowest window (1280 px with both side panes), and two lines tall
        # however the splitter squeezes it: a clipped hint reads as a broken box.
        self.edit.setPlaceholderText(PLACEHOLDER)
        line = self.edit.fontMetrics().lineSpacing()
        self.edit.setMinimumHeight(2 * line + 16)
        self.edit.setMaximumHeight(4 * line + 16)
        self.edit.submit.connect(self.send_requested)
        self.edit.files_pasted.connect(self.files_chosen)
        self.edit.textChanged.connect(self.changed)
        lay.addWidget(self.edit)
        row = QHBoxLayout()
        self.attach_btn = QPushButton("Attach…")
        self.attach_btn.setToolTip("Attach plain-text files (text, Markdown, source code)")
        self.attach_btn.clicked.connect(self._choose_files)
        row.addWidget(self.attach_btn)
        self.gauge = QProgressBar()
        self.gauge.setObjectName("contextGauge")
        self.gauge.setTextVisible(True)
        self.gauge.setRange(0, 1)
        self.gauge.setValue(0)
        self.gauge.setFormat("context: no model loaded")
        row.addWidget(self.gauge, 1)
        self.send_btn = QPushButton("Send")
        self.send_btn.setDefault(True)
        self.send_btn.clicked.connect(self.send_requested)
        self.stop_btn = QPushButton("■ Stop")
        self.stop_btn.clicked.connect(self.stop_requested)
        self.stop_btn.hide()
        row.addWidget(self.send_btn)
        row.addWidget(self.stop_btn)
        lay.addLayout(row)
        self.policy_label = QLabel()
        self.policy_label.setObjectName("contextPolicy")
        self.policy_label.setWordWrap(True)
        self.policy_label.hide()
        lay.addWidget(self.policy_label)
        self.attachments: list[Attachment] = []
        self.chips: list[AttachmentChip] = []
        self.plan: ContextPlan | None = None

    # -- draft ----------------------------------------------------------------------------------
    def text(self) -> str:
        return self.edit.toPlainText()

    def clear(self) -> None:
        self.edit.clear()
        for a in list(self.attachments):
            self.remove_attachment(a)

    def add_attachment(self, a: Attachment) -> AttachmentChip:
        chip = AttachmentChip(a)
        chip.removed.connect(self.remove_attachment)
        self.chips_row.insertWidget(self.chips_row.count() - 1, chip)
        self.attachments.append(a)
        self.chips.append(chip)
        self.changed.emit()
        return chip

    def remove_attachment(self, a: Attachment) -> None:
        i = self.attachments.index(a)
        self.attachments.pop(i)
        self.chips.pop(i).deleteLater()
        self.changed.emit()

    def set_attachment_tokens(self, a: Attachment, n: int | None) -> None:
        a.tokens = n
        for chip in self.chips:
            if chip.attachment is a:
                chip.refresh()

    def _choose_files(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach text files", "",
                                                "Text and code (*.txt *.md *.py *.c *.h *.cpp *.rs *.go *.js *.ts "
                                                "*.java *.json *.toml *.yaml *.yml *.sh *.html *.css *.sql *.csv);;"
                                                "All files (*)")
        if paths:
            self.files_chosen.emit(paths)

    # -- state ----------------------------------------------------------------------------------
    def set_busy(self, busy: bool) -> None:
        self.send_btn.setVisible(not busy)
        self.stop_btn.setVisible(busy)
        self.stop_btn.setEnabled(busy)

    def set_plan(self, plan: ContextPlan | None, note: str = "") -> None:
        """Show the context gauge: prompt tokens against the window, and what the overflow policy will do."""
        self.plan = plan
        if plan is None:
            self.gauge.setRange(0, 1)
            self.gauge.setValue(0)
            self.gauge.setFormat(note or "context: counting…")
            self.gauge.setProperty("level", "")
            self.policy_label.hide()
        else:
            self.gauge.setRange(0, plan.max_context)
            self.gauge.setValue(min(plan.full_tokens, plan.max_context))
            self.gauge.setFormat(f"context: {plan.full_tokens:,} / {plan.max_context:,} tokens "
                                 f"({100 * plan.full_tokens / plan.max_context:.0f}%)")
            self.gauge.setToolTip(f"Prompt tokens under the model's chat template, counted by the engine. "
                                  f"Up to {plan.limit:,} may be sent; the rest of the {plan.max_context:,}-token "
                                  f"window is kept for the reply.")
            level = {"ok": "warn" if plan.full_tokens > 0.8 * plan.limit else "", "drop": "warn", "refuse": "over"}
            self.gauge.setProperty("level", level[plan.action])
            self.policy_label.setText("" if plan.action == "ok" else "⚠ " + plan.describe())
            self.policy_label.setProperty("level", level[plan.action])
            self.policy_label.setVisible(plan.action != "ok")
            for w in (self.policy_label,):
                w.style().unpolish(w)
                w.style().polish(w)
        self.gauge.style().unpolish(self.gauge)
        self.gauge.style().polish(self.gauge)
