"""The conversation: one MessageWidget per message (Markdown body, actions, stats) in a scroll area."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QScrollArea, QSizePolicy,
                               QTextBrowser, QToolButton, QVBoxLayout, QWidget)

from app.markdown import code_groups, render_markdown
from app.reasoning_view import ReasoningBlock

FINISH_REASONS = {"stop": "end of turn", "length": "reply length limit", "stopped": "stopped by you",
                  "context_full": "context window full"}


def _num(v, fmt: str, unit: str = "") -> str:
    return "n/a" if v is None else f"{v:{fmt}}{unit}"


def format_stats(stats: dict | None) -> str:
    """One line from a reply's GenerationResult fields: TTFT, tokens/s, tokens, why it ended."""
    if not stats:
        return ""
    parts = [f"TTFT {_num(stats.get('ttft_s'), '.2f', ' s')}",
             f"{_num(stats.get('decode_tok_s'), '.1f', ' tok/s')}",
             f"{stats.get('completion_tokens', 'n/a')} tokens"]
    if stats.get("prompt_tokens") is not None:
        parts.append(f"prompt {stats['prompt_tokens']} ({stats.get('prefilled_tokens', '?')} computed)")
    reason = stats.get("finish_reason")
    parts.append(FINISH_REASONS.get(reason, reason or "n/a"))
    return " · ".join(parts)


class MarkdownView(QTextBrowser):
    """Read-only Markdown that is exactly as tall as its text (the outer scroll area scrolls)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setOpenLinks(False)  # offline app: a link is text to read, not a place to go
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.viewport().setAutoFillBackground(False)
        self.source_text = ""
        self.copy_buttons: list[QToolButton] = []

    def set_text(self, text: str) -> None:
        self.source_text = text
        base = self.palette().color(QPalette.ColorRole.Base)
        shade = QColor(base).darker(106) if base.lightness() > 128 else QColor(base).lighter(135)
        render_markdown(self.document(), text, shade)
        self._fit()
        self._place_copy_buttons()

    def resizeEvent(self, event):
        super().resizeEvent(event)
        self._fit()
        self._place_copy_buttons()

    def _place_copy_buttons(self) -> None:
        """A "Copy" button at the top right of every code block (what people copy from a reply)."""
        groups = code_groups(self.document())
        while len(self.copy_buttons) < len(groups):
            b = QToolButton(self.viewport())
            b.setObjectName("copyCode")
            b.setText("Copy")
            b.setToolTip("Copy this code block")
            b.setCursor(Qt.CursorShape.PointingHandCursor)
            b.clicked.connect(lambda _=False, b=b: self._copy_code(b))
            self.copy_buttons.append(b)
        layout = self.document().documentLayout()
        for i, b in enumerate(self.copy_buttons):
            if i >= len(groups):
                b.hide()
                continue
            first, text = groups[i]
            b.code = text
            b.adjustSize()
            top = layout.blockBoundingRect(first).top() - self.verticalScrollBar().value()
            b.move(self.viewport().width() - b.width() - 4, int(top) + 2)
            b.show()

    def _copy_code(self, button) -> None:
        QGuiApplication.clipboard().setText(button.code)
        button.setText("Copied")
        QTimer.singleShot(1500, button, lambda: button.setText("Copy"))  # cancelled if the reply is redrawn

    def _fit(self) -> None:
        self.document().setTextWidth(self.viewport().width())
        h = int(self.document().size().height()) + 4
        if self.horizontalScrollBar().isVisible():
            h += self.horizontalScrollBar().height()
        if self.height() != h:
            self.setFixedHeight(h)


class MessageWidget(QFrame):
    edit_submitted = Signal(int, str)  # message id, new text
    regenerate_requested = Signal(int)  # message id of the reply to redo
    alternative_requested = Signal(int, int)  # message id, -1 (‹) or +1 (›)

    def __init__(self, message, branch: tuple[int, int] | None = None, parent=None):
        super().__init__(parent)
        self.message = message
        self.setObjectName("userMessage" if message.role == "user" else "assistantMessage")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(10, 6, 10, 6)
        head = QHBoxLayout()
        self.role_label = QLabel("<b>You</b>" if message.role == "user" else "<b>Assistant</b>")
        self.tag = QLabel()
        self.tag.setObjectName("messageTag")
        head.addWidget(self.role_label)
        self.prev_btn = self._button("‹", "The previous alternative here", lambda: self._step(-1))
        self.branch_label = QLabel()
        self.branch_label.setObjectName("branchLabel")
        self.next_btn = self._button("›", "The next alternative here", lambda: self._step(1))
        for w in (self.prev_btn, self.branch_label, self.next_btn):
            head.addWidget(w)
        self.prev_btn.setObjectName("branchButton")
        self.next_btn.setObjectName("branchButton")
        self.set_branch(branch)
        head.addWidget(self.tag)
        head.addStretch(1)
        self.copy_btn = self._button("Copy", "Copy this message as Markdown", self.copy)
        head.addWidget(self.copy_btn)
        self.edit_btn = self.regen_btn = None
        if message.role == "user":
            self.edit_btn = self._button("Edit", "Edit and send again; the original stays as an alternative (‹ ›)",
                                         self.begin_edit)
            head.addWidget(self.edit_btn)
        else:
            self.regen_btn = self._button("Regenerate", "Generate another reply; this one stays as an alternative (‹ ›)",
                                          lambda: self.regenerate_requested.emit(self.message.id))
            head.addWidget(self.regen_btn)
        lay.addLayout(head)
        self.reasoning = ReasoningBlock()  # above the answer, folded; hidden when there is none
        lay.addWidget(self.reasoning)
        self.body = MarkdownView()
        lay.addWidget(self.body)
        self.editor = None
        self.outside = False  # left out of the prompt by the overflow policy
        self.reading: tuple[int, int] | None = None  # prompt tokens read so far, of all (while it reads)
        self.stats_label = QLabel()
        self.stats_label.setObjectName("messageStats")
        self.stats_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        lay.addWidget(self.stats_label)
        self.refresh()

    def set_branch(self, branch: tuple[int, int] | None) -> None:
        """‹ 2/3 ›: this message has alternatives (regenerated replies, edited questions)."""
        self.branch = branch
        for w in (self.prev_btn, self.branch_label, self.next_btn):
            w.setVisible(branch is not None)
        if branch is not None:
            self.branch_label.setText(f"{branch[0]}/{branch[1]}")
            self.prev_btn.setEnabled(branch[0] > 1)
            self.next_btn.setEnabled(branch[0] < branch[1])

    def _step(self, step: int) -> None:
        self.alternative_requested.emit(self.message.id, step)

    def _button(self, text, tip, slot) -> QPushButton:
        b = QPushButton(text)
        b.setToolTip(tip)
        b.setFlat(True)
        b.clicked.connect(slot)
        return b

    def refresh(self, streaming_text: str | None = None, streaming_reasoning: str | None = None) -> None:
        m = self.message
        text = streaming_text if streaming_text is not None else m.content
        reasoning = streaming_reasoning if streaming_reasoning is not None else m.reasoning
        self.reasoning.set_reasoning(reasoning, thinking=m.status == "streaming" and not text)
        self.body.set_text(text)
        self._update_tag()
        self.stats_label.setText(format_stats(m.stats))
        self.stats_label.setVisible(bool(m.stats) or m.status == "error")
        if m.status == "error" and m.stats:
            self.stats_label.setText(f"{m.stats.get('what', '')} — {m.stats.get('remedy', '')}")

    def set_reading(self, done: int, total: int) -> None:
        """The engine is still reading the prompt: say how far, until the first words arrive."""
        self.reading = (done, total)
        self._update_tag()

    def _update_tag(self) -> None:
        tags = {"streaming": "generating…", "interrupted": "interrupted (the app closed mid-reply)",
                "error": "failed"}
        text = tags.get(self.message.status, "")
        if self.message.status == "streaming" and self.reading and not self.body.source_text \
                and not self.reasoning.text.text():  # the first words, answer or reasoning, end the reading
            text = f"reading {self.reading[0]:,} / {self.reading[1]:,} tokens…"
        self.tag.setText("not sent: outside the context window" if self.outside else text)

    def set_outside_context(self, outside: bool) -> None:
        if outside == self.outside:
            return
        self.outside = outside
        self.setProperty("outsideContext", outside)
        self._update_tag()
        self.style().unpolish(self)
        self.style().polish(self)

    def set_actions_enabled(self, enabled: bool, is_last_reply: bool = False) -> None:
        if self.edit_btn is not None:
            self.edit_btn.setEnabled(enabled)
        if self.branch is not None:  # no switching branches under a reply that is streaming
            self.prev_btn.setEnabled(enabled and self.branch[0] > 1)
            self.next_btn.setEnabled(enabled and self.branch[0] < self.branch[1])
        if self.regen_btn is not None:  # not on a reply still being written: there is nothing to redo yet
            self.regen_btn.setVisible(is_last_reply and self.message.status != "streaming")
            self.regen_btn.setEnabled(enabled)

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.body.source_text)

    def begin_edit(self) -> None:
        if self.editor is not None:
            return
        self.editor = QWidget()
        v = QVBoxLayout(self.editor)
        v.setContentsMargins(0, 0, 0, 0)
        self.edit_box = QPlainTextEdit(self.message.content)
        self.edit_box.setMinimumHeight(80)
        row = QHBoxLayout()
        row.addStretch(1)
        cancel, send = QPushButton("Cancel"), QPushButton("Save && resend")
        cancel.clicked.connect(self.end_edit)
        send.clicked.connect(self._submit_edit)
        row.addWidget(cancel)
        row.addWidget(send)
        v.addWidget(self.edit_box)
        v.addLayout(row)
        self.layout().insertWidget(self.layout().indexOf(self.body), self.editor)
        self.body.hide()
        self.edit_box.setFocus()

    def _submit_edit(self) -> None:
        text = self.edit_box.toPlainText()
        self.end_edit()
        if text.strip():
            self.edit_submitted.emit(self.message.id, text)

    def end_edit(self) -> None:
        if self.editor is not None:
            self.editor.deleteLater()
            self.editor = None
            self.body.show()


class ChatView(QScrollArea):
    edit_submitted = Signal(int, str)
    regenerate_requested = Signal(int)
    alternative_requested = Signal(int, int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.container = QWidget()
        self.container.setObjectName("chatContainer")
        self.vbox = QVBoxLayout(self.container)
        self.vbox.setSpacing(8)
        self.vbox.addStretch(1)
        self.setWidget(self.container)
        self.widgets: list[MessageWidget] = []
        self.notice = QLabel()
        self.notice.setObjectName("contextNotice")
        self.notice.setWordWrap(True)
        self.notice.hide()
        self.empty_label = QLabel("Say something to start the chat. Attach text files with Attach… or by pasting "
                                  "or dropping them on the message box.")
        self.empty_label.setObjectName("emptyHint")
        self.empty_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.vbox.insertWidget(0, self.empty_label)
        self._stick_to_bottom = True
        self.verticalScrollBar().rangeChanged.connect(self._on_range)
        self.verticalScrollBar().valueChanged.connect(self._on_scroll)

    def set_messages(self, messages, branches: dict | None = None) -> None:
        for w in self.widgets:  # out of the layout now: a later deleteLater must not leave them on screen meanwhile
            w.hide()
            self.vbox.removeWidget(w)
            w.deleteLater()
        self.widgets = []
        for m in messages:
            self.append(m, (branches or {}).get(m.id))
        self.empty_label.setVisible(not messages)
        self._stick_to_bottom = True
        self.scroll_to_bottom()

    def append(self, message, branch: tuple[int, int] | None = None) -> MessageWidget:
        w = MessageWidget(message, branch)
        w.edit_submitted.connect(self.edit_submitted)
        w.regenerate_requested.connect(self.regenerate_requested)
        w.alternative_requested.connect(self.alternative_requested)
        self.vbox.insertWidget(self.vbox.count() - 1, w)
        self.widgets.append(w)
        self.empty_label.hide()
        return w

    def widget_for(self, message_id: int) -> MessageWidget | None:
        return next((w for w in self.widgets if w.message.id == message_id), None)

    def mark_dropped(self, dropped: int, max_context: int | None) -> None:
        """Mark the oldest `dropped` messages as left out of the prompt and say so above the rest."""
        for i, w in enumerate(self.widgets):
            w.set_outside_context(i < dropped)
        self.vbox.removeWidget(self.notice)
        if dropped and dropped <= len(self.widgets):
            self.notice.setText(f"⚠ The {dropped} oldest message{'s are' if dropped != 1 else ' is'} left out of the "
                                f"prompt: the chat is longer than the model's context window "
                                f"({max_context or 0:,} tokens). Policy: drop the oldest turns (chat settings).")
            self.vbox.insertWidget(self.vbox.indexOf(self.widgets[dropped - 1]) + 1, self.notice)
            self.notice.show()
        else:
            self.notice.hide()

    def set_actions_enabled(self, enabled: bool) -> None:
        last_reply = next((w for w in reversed(self.widgets) if w.message.role == "assistant"), None)
        for w in self.widgets:
            w.set_actions_enabled(enabled, w is last_reply and w is self.widgets[-1])

    def _on_scroll(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._stick_to_bottom = value >= bar.maximum() - 24

    def _on_range(self, lo: int, hi: int) -> None:
        if self._stick_to_bottom:
            self.verticalScrollBar().setValue(hi)

    def scroll_to_bottom(self) -> None:
        QTimer.singleShot(0, lambda: self.verticalScrollBar().setValue(self.verticalScrollBar().maximum()))
