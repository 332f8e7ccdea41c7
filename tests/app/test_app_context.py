"""The context budget: counting with the engine's template, the overflow policies, attachments."""

import pytest

from app.context import (AttachmentError, build_messages, compose_message, plan_context, read_text_file,
                         reply_reserve)


def _history(turns: int) -> list[dict]:
    out = []
    for i in range(turns):
        out += [{"role": "user", "content": f"Question number {i}: tell me about the number {i}."},
                {"role": "assistant", "content": f"The number {i} is a fine number, one of many. " * 3}]
    return out


def test_plan_fits_drops_whole_oldest_turns_or_refuses(moe_engine):
    render = moe_engine.render
    hist = _history(6)
    full = len(render(build_messages("Be brief.", hist, "And 7?")))
    ok = plan_context(render, "Be brief.", hist, "And 7?", max_context=4096, max_new_tokens=64, policy="refuse")
    assert (ok.action, ok.tokens, ok.dropped) == ("ok", full, 0)

    ctx = full  # the whole chat fits the window, but not with room for a 64-token reply
    drop = plan_context(render, "Be brief.", hist, "And 7?", max_context=ctx, max_new_tokens=64,
                        policy="drop_oldest")
    assert drop.action == "drop" and drop.dropped % 2 == 0 and drop.dropped > 0  # whole turns only
    kept = build_messages("Be brief.", hist[drop.dropped:], "And 7?")
    assert drop.tokens == len(render(kept)) <= ctx - reply_reserve(ctx, 64)
    # The fewest turns were dropped: keeping one more turn would not fit.
    assert len(render(build_messages("Be brief.", hist[drop.dropped - 2:], "And 7?"))) > drop.limit
    assert f"oldest {drop.dropped} messages will be left out" in drop.describe()

    refuse = plan_context(render, "Be brief.", hist, "And 7?", max_context=ctx, max_new_tokens=64, policy="refuse")
    assert refuse.action == "refuse" and not refuse.fits and "will not send" in refuse.describe()
    # When even the system prompt and the new message alone are too long, dropping cannot help.
    tiny = plan_context(render, "Be brief.", hist, "And 7?", max_context=24, max_new_tokens=4, policy="drop_oldest")
    assert tiny.action == "refuse"


def test_attachments_are_read_as_text_and_binary_is_refused(tmp_path):
    src = tmp_path / "demo.py"
    src.write_text("def add(a, b):\n    return a + b\n")
    a = read_text_file(src)
    assert a.name == "demo.py" and "return a + b" in a.text
    msg = compose_message("Explain this:", [a])
    assert msg.startswith("Explain this:\n\nFile `demo.py`:\n```python\ndef add")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    with pytest.raises(AttachmentError, match="binary"):
        read_text_file(tmp_path / "blob.bin")
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(AttachmentError, match="not UTF-8"):
        read_text_file(tmp_path / "latin.txt")


def test_attach_shows_token_count_before_sending(qtbot, open_window, moe_engine, tmp_path):
    w = open_window()
    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\nTandem runs the GPU and the CPU together.\n")
    w.conv.attach([str(notes), str(tmp_path / "missing.txt")])
    assert "missing.txt" in w.statusBar().currentMessage()  # the unreadable one is refused, visibly
    assert len(w.composer.attachments) == 1
    a = w.composer.attachments[0]
    qtbot.waitUntil(lambda: a.tokens is not None, timeout=10_000)
    assert a.tokens == len(moe_engine.tokenize(a.as_prompt()))
    assert f"notes.md — {a.tokens:,} tokens" in w.composer.chips[0].label.text()
    # The gauge counts the draft with its attachment.
    qtbot.waitUntil(lambda: w.composer.plan is not None and w.composer.plan.tokens > a.tokens, timeout=10_000)
    assert w.composer.plan.tokens == len(moe_engine.render(build_messages("", [], w.conv.draft())))


def test_overflow_is_refused_visibly_and_nothing_is_sent(qtbot, open_window, moe_engine, tmp_path):
    w = open_window()
    chat = w.store.chat(w.conv.chat_id)
    w.apply_chat_settings({**chat.settings, "overflow": "refuse"})
    big = tmp_path / "big.txt"
    big.write_text("word " * (moe_engine.max_context + 500))  # more tokens than the window holds
    w.conv.attach([str(big)])
    qtbot.waitUntil(lambda: w.composer.plan is not None and w.composer.plan.action == "refuse", timeout=30_000)
    assert w.composer.policy_label.isVisibleTo(w) and "will not send" in w.composer.policy_label.text()
    assert w.composer.gauge.property("level") == "over"
    w.composer.send_btn.click()
    qtbot.waitUntil(lambda: w.statusBar().currentMessage().startswith("Not sent"), timeout=30_000)
    assert w.store.messages(w.conv.chat_id) == []  # nothing written, nothing generated
    assert w.composer.attachments  # the draft is kept for the user to shorten


def test_drop_oldest_marks_the_left_out_turns(qtbot, open_window, moe_engine):
    w = open_window()
    cid = w.conv.chat_id
    long_answer = "This is a long answer that fills the context window quickly. " * 150
    for i in range(6):  # a stored history longer than the window (as after a long session)
        w.store.add_message(cid, "user", f"Question {i}?")
        w.store.add_message(cid, "assistant", long_answer)
    w.show_chat(cid)
    qtbot.waitUntil(lambda: w.composer.plan is not None and w.composer.plan.action == "drop", timeout=30_000)
    plan = w.composer.plan
    assert plan.full_tokens > plan.limit >= plan.tokens and plan.dropped >= 2
    assert w.view.notice.isVisibleTo(w) and f"The {plan.dropped} oldest messages are left out" in w.view.notice.text()
    assert [x.outside for x in w.view.widgets] == [i < plan.dropped for i in range(12)]
    assert w.view.widgets[0].tag.text() == "not sent: outside the context window"
    assert "will be left out" in w.composer.policy_label.text()
