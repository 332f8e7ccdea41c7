"""The conversation controller: send, stream, stop, regenerate, edit-and-resend, the context gauge.

Every action first asks the worker for a ContextPlan of exactly what would be sent, then acts on
it: a refused plan leaves the chat untouched and says why; a plan that drops old turns marks them
in the view. Only then are messages written and the generation started. The reply is one DB row
(status 'streaming') whose text is rewritten at most every DB_FLUSH_S while tokens arrive, and
closed with its GenerationResult stats when the worker reports `finished`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from PySide6.QtCore import QObject, QTimer, Signal

from app.chat_settings import request_fields
from app.context import AttachmentError, build_messages, compose_message, read_text_file
from app.db import ChatStore, Message, StoreError

DB_FLUSH_S = 0.5
REPLAN_DELAY_MS = 250


@dataclass
class Job:
    job_id: str
    chat_id: str
    message_id: int
    text: str = ""
    reasoning: str = ""  # a reasoning model's thinking so far, kept apart from the answer (text)
    flushed_at: float = 0.0
    reading: tuple[int, int] | None = None  # the engine's progress through the prompt, until the first token


@dataclass
class Pending:
    """An action waiting for its ContextPlan."""

    kind: str  # send | regenerate | edit
    chat_id: str
    history: list[Message]
    draft: str
    branch_at: int | None  # regenerate/edit: the message the new one follows (a new branch there; None: the root)


def history_dicts(messages: list[Message]) -> list[dict]:
    """What the model sees of the past: failed replies are left out (their text is an error, not an answer),
    and a reply's reasoning is never sent back, only its answer (harmony's rule: earlier analysis is dropped)."""
    return [{"role": m.role, "content": m.content} for m in messages if m.status != "error"]


class Conversation(QObject):
    busy_changed = Signal(bool)
    chats_changed = Signal()  # a title or ordering changed: the list reloads
    notice = Signal(str)  # a short message for the status bar
    streamed = Signal(str)  # a batch of reply text, after the view showed it
    reply_finished = Signal(str, dict)  # status (done | error), the result's fields (or what/remedy)

    def __init__(self, store: ChatStore, host, view, composer, parent=None):
        super().__init__(parent)
        self.store, self.host, self.view, self.composer = store, host, view, composer
        self.chat_id = ""
        self.messages: list[Message] = []
        self.job: Job | None = None
        self.pending: Pending | None = None
        self.pending_req = -1
        self.gauge_req = -1
        self.count_reqs: dict = {}
        self._replan = QTimer(self)
        self._replan.setSingleShot(True)
        self._replan.setInterval(REPLAN_DELAY_MS)
        self._replan.timeout.connect(self.replan)
        w = host.worker
        w.tokens.connect(self._on_tokens)
        w.reasoning.connect(self._on_reasoning)
        w.prefill_progress.connect(self._on_prefill)
        w.finished.connect(self._on_finished)
        w.failed.connect(self._on_failed)
        w.planned.connect(self._on_planned)
        w.counted.connect(self._on_counted)
        host.state_changed.connect(lambda s: self.schedule_replan() if s == "ready" else None)
        composer.send_requested.connect(self.send)
        composer.stop_requested.connect(self.stop)
        composer.changed.connect(self.schedule_replan)
        composer.files_chosen.connect(self.attach)
        view.edit_submitted.connect(self.edit)
        view.regenerate_requested.connect(self.regenerate)
        view.alternative_requested.connect(self.show_alternative)

    # -- chat selection -------------------------------------------------------------------------
    def settings(self) -> dict:
        chat = self.store.chat(self.chat_id)
        return chat.settings if chat else {}

    def set_chat(self, chat_id: str) -> None:
        self.chat_id = chat_id
        self.messages = self.store.messages(chat_id) if chat_id else []
        self.view.set_messages(self.messages, self.store.branches(self.messages))
        if self.job and self.job.chat_id == chat_id:  # a reply streams here: show it as far as it got
            w = self.view.widget_for(self.job.message_id)
            if w is not None:
                w.reading = self.job.reading
                w.refresh(self.job.text, self.job.reasoning)
        self.view.set_actions_enabled(self.job is None)
        self.composer.setEnabled(bool(chat_id))
        self.schedule_replan()

    # -- the gauge ------------------------------------------------------------------------------
    def schedule_replan(self) -> None:
        self._replan.start()

    def _plan_args(self, history: list[Message], draft: str | None) -> dict:
        s = self.settings()
        return {"system_prompt": s.get("system_prompt", ""), "history": history_dicts(history), "draft": draft,
                "max_new_tokens": s.get("max_new_tokens", 512), "policy": s.get("overflow", "drop_oldest")}

    def draft(self) -> str:
        return compose_message(self.composer.text(), self.composer.attachments)

    def replan(self) -> None:
        if not self.chat_id or self.host.state != "ready":
            self.composer.set_plan(None, "context: no model loaded" if self.host.state != "loading" else
                                   "context: loading the model…")
            return
        self.gauge_req = self.host.plan(self._plan_args(self.messages, self.draft() or None))

    def _on_planned(self, rid: int, plan) -> None:
        if rid == self.gauge_req:
            self.composer.set_plan(plan)
            if plan is not None and self.job is None:
                self.view.mark_dropped(plan.dropped, plan.max_context)
        elif rid == self.pending_req and self.pending is not None:
            action, self.pending = self.pending, None
            self._act(action, plan)

    # -- attachments ----------------------------------------------------------------------------
    def attach(self, paths: list) -> None:
        for path in paths:
            try:
                a = read_text_file(path)
            except AttachmentError as e:
                self.notice.emit(f"Not attached: {e}")
                continue
            self.composer.add_attachment(a)
            self.count_reqs[self.host.count(a.as_prompt())] = a

    def _on_counted(self, rid: int, n) -> None:
        a = self.count_reqs.pop(rid, None)
        if a is not None and a in self.composer.attachments:
            self.composer.set_attachment_tokens(a, n)

    # -- actions --------------------------------------------------------------------------------
    def _request(self, kind: str, history: list[Message], draft: str, branch_at: int | None) -> bool:
        if self.job is not None or self.pending is not None:
            self.notice.emit("Wait for the current reply to finish (or stop it) first.")
            return False
        if self.host.state != "ready":
            self.notice.emit("No model is loaded yet; the message was not sent.")
            return False
        self.pending = Pending(kind, self.chat_id, history, draft, branch_at)
        self.pending_req = self.host.plan(self._plan_args(history, draft))
        self._set_busy(True)
        return True

    def send(self) -> None:
        draft = self.draft()
        if self.chat_id and draft.strip():
            self._request("send", self.messages, draft, None)

    def regenerate(self, message_id: int) -> None:
        i = next((i for i, m in enumerate(self.messages) if m.id == message_id), None)
        if i is None or i == 0 or self.messages[i].role != "assistant":
            return
        user = self.messages[i - 1]  # the reply's question is sent again as the draft
        self._request("regenerate", self.messages[:i - 1], user.content, user.id)  # a sibling of this reply

    def regenerate_last(self) -> None:
        last = next((m for m in reversed(self.messages) if m.role == "assistant"), None)
        if last is not None and last is self.messages[-1]:
            self.regenerate(last.id)

    def edit(self, message_id: int, text: str) -> None:
        i = next((i for i, m in enumerate(self.messages) if m.id == message_id), None)
        if i is not None and self.messages[i].role == "user":
            self._request("edit", self.messages[:i], text, self.messages[i].parent_id)  # a sibling of the original

    def _act(self, p: Pending, plan) -> None:
        if plan is None or not plan.fits or p.chat_id != self.chat_id:
            self._set_busy(False)
            if p.chat_id != self.chat_id:
                self.notice.emit("Not sent: another chat was opened before the message went out.")
            elif plan is None:
                self.notice.emit("Not sent: the prompt could not be counted (is a model loaded?).")
            else:
                self.composer.set_plan(plan)
                self.notice.emit("Not sent: " + plan.describe())
            return
        try:
            if p.kind != "send":  # a new branch: what followed stays reachable through ‹ › on the message
                self.store.show_branch_end(p.chat_id, p.branch_at)
            if p.kind != "regenerate":  # a regenerated reply answers the user message already stored
                self.store.add_message(p.chat_id, "user", p.draft)
            self._maybe_title(p.chat_id, p.draft)
            reply_id = self.store.add_message(p.chat_id, "assistant", "", status="streaming")
        except StoreError as e:  # nothing is generated that could not be kept; the draft stays in the box
            self._set_busy(False)
            self.set_chat(p.chat_id)
            self.notice.emit(f"Not sent: {e.what}. {e.remedy}")
            return
        if p.kind == "send":
            self.composer.clear()
        self.job = Job(uuid.uuid4().hex, p.chat_id, reply_id, flushed_at=time.monotonic())
        self.set_chat(p.chat_id)
        self.view.mark_dropped(plan.dropped, plan.max_context)
        self.composer.set_plan(plan)
        s = self.settings()
        request = {"messages": build_messages(s.get("system_prompt", ""), history_dicts(p.history)[plan.dropped:],
                                              p.draft),
                   "session_id": p.chat_id, **request_fields(s)}
        self.host.generate(self.job.job_id, request)
        self.chats_changed.emit()

    def _maybe_title(self, chat_id: str, text: str) -> None:
        chat = self.store.chat(chat_id)
        if chat is not None and chat.title == "New chat":
            line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "New chat")
            self.store.rename_chat(chat_id, line[:48] + ("…" if len(line) > 48 else ""))

    def stop(self) -> None:
        if self.job is not None:
            self.host.stop()
            self.notice.emit("Stopping…")

    # -- worker reports -------------------------------------------------------------------------
    def _on_tokens(self, job_id: str, text: str) -> None:
        job = self.job
        if job is None or job.job_id != job_id:
            return
        job.text += text
        self._show_progress(job)
        self.streamed.emit(text)

    def _on_reasoning(self, job_id: str, text: str) -> None:
        job = self.job
        if job is None or job.job_id != job_id:
            return
        job.reasoning += text
        self._show_progress(job)

    def _show_progress(self, job: Job) -> None:
        """The reply so far on screen, and in the file every DB_FLUSH_S."""
        now = time.monotonic()
        if now - job.flushed_at >= DB_FLUSH_S:
            job.flushed_at = now
            try:
                self.store.update_streaming(job.message_id, job.text, job.reasoning)
            except StoreError as e:  # the reply goes on in memory; the next flush tries again
                self.notice.emit(f"The reply could not be saved yet: {e.what}. {e.remedy}")
        if job.chat_id == self.chat_id:
            w = self.view.widget_for(job.message_id)
            if w is not None:
                w.refresh(job.text, job.reasoning)

    def _on_prefill(self, job_id: str, done: int, total: int) -> None:
        job = self.job
        if job is None or job.job_id != job_id:
            return
        job.reading = (done, total)
        if job.chat_id == self.chat_id:
            w = self.view.widget_for(job.message_id)
            if w is not None:
                w.set_reading(done, total)

    def show_alternative(self, message_id: int, step: int) -> None:
        """‹ / ›: show the previous or next alternative at this message's place (and its branch)."""
        if self.job is not None or self.pending is not None:
            self.notice.emit("Wait for the current reply to finish (or stop it) first.")
            return
        m = next((m for m in self.messages if m.id == message_id), None)
        if m is None:
            return
        sib = self.store.siblings(m)
        i = sib.index(m.id) + step
        if 0 <= i < len(sib):
            self.store.show_branch(self.chat_id, sib[i])
            self.set_chat(self.chat_id)

    def _on_finished(self, job_id: str, result: dict) -> None:
        if self.job is None or self.job.job_id != job_id:
            return
        self._close_job(result["text"], {k: v for k, v in result.items() if k not in ("text", "reasoning")}, "done",
                        result.get("reasoning", ""))

    def _on_failed(self, job_id: str, what: str, remedy: str) -> None:
        if self.job is None or self.job.job_id != job_id:
            return
        self.notice.emit(f"The reply failed: {what}")
        self._close_job(self.job.text, {"what": what, "remedy": remedy}, "error", self.job.reasoning)

    def _close_job(self, text: str, stats: dict, status: str, reasoning: str = "") -> None:
        job, self.job = self.job, None
        try:
            self.store.finish_message(job.message_id, text, stats, status, reasoning)
        except StoreError as e:  # the app goes on; the row keeps the text of its last successful save
            self.notice.emit(f"The reply could not be saved: {e.what}. {e.remedy}")
        self._set_busy(False)
        if job.chat_id == self.chat_id:
            self.set_chat(self.chat_id)
        self.chats_changed.emit()
        self.reply_finished.emit(status, {"text": text, "reasoning": reasoning, **stats})

    def abandon(self) -> None:
        """On quit with a reply still open: keep its text, marked as interrupted."""
        if self.job is not None:
            try:
                self.store.finish_message(self.job.message_id, self.job.text, None, "interrupted", self.job.reasoning)
            except StoreError:  # quitting anyway: the next start marks the row interrupted
                pass
            self.job = None

    def _set_busy(self, busy: bool) -> None:
        self.composer.set_busy(busy)
        self.view.set_actions_enabled(not busy)
        self.busy_changed.emit(busy)
