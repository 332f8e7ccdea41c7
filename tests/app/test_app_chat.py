"""The chat window on the real engine: stream, stop, regenerate, edit, restart, delete, search."""

from gui_helpers import REPLY_TIMEOUT_MS, send_and_wait, set_chat

from app.context import build_messages


def test_send_streams_the_answer(qtbot, open_window, moe_engine):
    w = open_window()
    set_chat(w, greedy=True, max_new_tokens=10)
    question = "What is the capital of France?"
    w.composer.edit.setPlainText(question)
    # The gauge counts the prompt with the engine's own template before anything is sent.
    qtbot.waitUntil(lambda: w.composer.plan is not None, timeout=10_000)
    assert w.composer.plan.tokens == len(moe_engine.render(build_messages("", [], question)))
    assert f"{w.composer.plan.tokens:,} / {moe_engine.max_context:,}" in w.composer.gauge.text()

    batches, shown = [], []

    def on_streamed(text):
        batches.append(text)
        shown.append(w.view.widgets[-1].body.source_text)  # what the view shows after this batch

    w.conv.streamed.connect(on_streamed)
    result = send_and_wait(qtbot, w, question)
    assert not w.composer.text()  # the draft went out
    assert "Paris" in result["text"]
    assert "".join(batches) == result["text"]  # streamed text adds up to the result, nothing lost
    assert shown[-1] == result["text"]
    if len(batches) > 1:
        assert 0 < len(shown[0]) < len(result["text"])  # partial text was on screen while streaming

    messages = w.store.messages(w.conv.chat_id)
    assert [(m.role, m.status) for m in messages] == [("user", "done"), ("assistant", "done")]
    assert messages[1].content == result["text"]
    assert messages[1].stats["completion_tokens"] == result["completion_tokens"]
    reply = w.view.widgets[-1]
    assert reply.body.source_text == result["text"]
    stats_line = reply.stats_label.text()
    assert "TTFT" in stats_line and "tok/s" in stats_line and f"{result['completion_tokens']} tokens" in stats_line
    assert w.store.chat(w.conv.chat_id).title == question  # titled from the first message
    assert len(w.timeline) > 0  # the worker reported stats during/after the reply


def test_stop_mid_reply(qtbot, open_window):
    w = open_window()
    set_chat(w, greedy=False, temperature=0.8, seed=1, max_new_tokens=400)
    w.composer.edit.setPlainText("Write a long story about a dragon who learns to cook.")
    with qtbot.waitSignal(w.conv.streamed, timeout=REPLY_TIMEOUT_MS):
        w.composer.send_btn.click()
    assert w.composer.stop_btn.isVisible() and not w.composer.send_btn.isVisible()
    assert w.store.messages(w.conv.chat_id)[-1].status == "streaming"
    # While it streams, the worker samples the engine between decode steps for the panels.
    qtbot.waitUntil(lambda: any(r["phase"] == "decode" for r in w.timeline.records), timeout=REPLY_TIMEOUT_MS)
    with qtbot.waitSignal(w.conv.reply_finished, timeout=REPLY_TIMEOUT_MS) as done:
        w.composer.stop_btn.click()
    result = done.args[1]
    assert result["finish_reason"] == "stopped"
    assert 0 < result["completion_tokens"] < 400
    reply = w.store.messages(w.conv.chat_id)[-1]
    assert reply.status == "done" and reply.content == result["text"] and reply.stats["finish_reason"] == "stopped"
    assert "stopped by you" in w.view.widgets[-1].stats_label.text()
    assert w.composer.send_btn.isVisible()


def test_regenerate_reuses_the_chat_kv(qtbot, open_window):
    w = open_window()
    set_chat(w, greedy=True, max_new_tokens=6)
    first = send_and_wait(qtbot, w, "Name a colour.")
    old = w.store.messages(w.conv.chat_id)
    reply_widget = w.view.widgets[-1]
    assert not reply_widget.regen_btn.isHidden()
    with qtbot.waitSignal(w.conv.reply_finished, timeout=REPLY_TIMEOUT_MS) as done:
        reply_widget.regen_btn.click()
    again = done.args[1]
    new = w.store.messages(w.conv.chat_id)
    assert [m.role for m in new] == ["user", "assistant"]
    assert new[0].id == old[0].id and new[1].id != old[1].id
    assert again["text"] == first["text"]  # greedy: the same answer again
    # session_id=<chat id>: the engine kept the prompt's KV and cropped to the common prefix.
    assert again["prompt_tokens"] == first["prompt_tokens"] and again["prefilled_tokens"] < first["prefilled_tokens"]


def test_edit_and_resend_replaces_the_rest(qtbot, open_window):
    w = open_window()
    set_chat(w, greedy=True, max_new_tokens=6)
    send_and_wait(qtbot, w, "What is the capital of Italy?")
    user_widget = w.view.widgets[0]
    user_widget.edit_btn.click()
    user_widget.edit_box.setPlainText("What is the capital of France?")
    with qtbot.waitSignal(w.conv.reply_finished, timeout=REPLY_TIMEOUT_MS):
        user_widget._submit_edit()
    msgs = w.store.messages(w.conv.chat_id)
    assert [(m.role, m.content.startswith("What is the capital of France")) for m in msgs] == \
        [("user", True), ("assistant", False)]
    assert "Paris" in msgs[1].content


def test_restart_finds_the_chat_and_list_operations(qtbot, open_window):
    w = open_window()
    set_chat(w, greedy=True, max_new_tokens=4)
    send_and_wait(qtbot, w, "Hello there")
    chat_id = w.conv.chat_id
    w.chat_list.rename(chat_id, "Greetings")
    w.close()
    w.store.close()

    w2 = open_window()  # a new window on the same data dir, as after a restart
    assert w2.conv.chat_id == chat_id  # the newest chat opens
    assert w2.chat_list.list.item(0).text().startswith("Greetings")
    assert [m.role for m in w2.store.messages(chat_id)] == ["user", "assistant"]
    assert w2.view.widgets[0].body.source_text == "Hello there"

    other = w2.chat_list.new_chat()
    assert w2.conv.chat_id == other and w2.chat_list.list.count() == 2
    w2.chat_list.search.setText("hello")  # matches the first chat's message text, not the new one
    assert w2.chat_list.list.count() == 1
    w2.chat_list.search.setText("")
    w2.chat_list.confirm_delete = False
    w2.chat_list.select(other)
    w2.chat_list.delete(other)
    assert w2.store.chat(other) is None and w2.chat_list.list.count() == 1
    assert w2.conv.chat_id == chat_id
