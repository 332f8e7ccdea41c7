"""Smaller pieces: Markdown with code blocks, copy, the stats line, the store, chat settings, the CLI door."""

import os
import sqlite3

from PySide6.QtGui import QGuiApplication

from app.chat_settings import ChatSettingsDialog, request_fields
from app.chat_view import MarkdownView, MessageWidget, format_stats
from app.db import DEFAULT_CHAT_SETTINGS, ChatStore
from app.markdown import code_blocks
from app.paths import InstanceLock
from engine.cli import main as cli_main


def test_markdown_renders_code_blocks_apart(qtbot):
    view = MarkdownView()
    qtbot.addWidget(view)
    view.set_text("Here is **code**:\n\n```python\ndef f():\n    return 1\n```\n\nDone.")
    doc = view.document()
    assert code_blocks(doc) == ["def f():\n    return 1"]
    assert "Here is code:" in doc.toPlainText() and "**" not in doc.toPlainText()
    block = doc.findBlock(doc.toPlainText().index("def f"))
    assert block.blockFormat().nonBreakableLines() and block.blockFormat().background().color().isValid()
    assert view.height() >= 3 * view.fontMetrics().height()  # tall enough for its lines


def test_copy_and_stats_line(qtbot, tmp_path):
    store = ChatStore(tmp_path / "c.sqlite3")
    chat = store.create_chat()
    stats = {"ttft_s": 0.25, "decode_tok_s": 12.34, "completion_tokens": 7, "prompt_tokens": 30,
             "prefilled_tokens": 2, "finish_reason": "length"}
    mid = store.add_message(chat.id, "assistant", "Use `x = 1`.", stats=stats)
    w = MessageWidget(store.messages(chat.id)[0])
    qtbot.addWidget(w)
    assert w.message.id == mid
    w.copy_btn.click()
    assert QGuiApplication.clipboard().text() == "Use `x = 1`."
    assert w.stats_label.text() == format_stats(stats) == \
        "TTFT 0.25 s · 12.3 tok/s · 7 tokens · prompt 30 (2 computed) · reply length limit"
    assert format_stats({"ttft_s": None, "decode_tok_s": None, "completion_tokens": 1,
                         "finish_reason": "stop"}) == "TTFT n/a · n/a · 1 tokens · end of turn"
    store.close()


def test_store_search_settings_and_recovery(tmp_path):
    path = tmp_path / "c.sqlite3"
    store = ChatStore(path)
    a, b = store.create_chat("Alpha"), store.create_chat("Beta")
    store.add_message(a.id, "user", "100% sure_thing")
    assert [c.id for c in store.chats("100%")] == [a.id]  # LIKE wildcards are matched literally
    assert [c.id for c in store.chats("_thing")] == [a.id]
    assert [c.id for c in store.chats("bet")] == [b.id]
    sid = store.add_message(b.id, "assistant", "", status="streaming")
    store.update_streaming(sid, "partial")
    store.set_setting("engine", {"model": "builtin:smollm2-135m"})
    assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    store.close()
    again = ChatStore(path)
    assert again.recovered == 1 and again.messages(b.id)[0].status == "interrupted"
    assert again.messages(b.id)[0].content == "partial"
    assert again.setting("engine") == {"model": "builtin:smollm2-135m"}
    again.delete_chat(a.id)
    assert again.messages(a.id) == [] and again.integrity() == "ok"
    again.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(*) FROM messages WHERE chat_id=?", (a.id,)).fetchone()[0] == 0
    conn.close()


def test_chat_settings_dialog_round_trip(qtbot):
    dlg = ChatSettingsDialog({"system_prompt": "Be kind.", "temperature": 0.3, "seed": 5, "overflow": "refuse"})
    qtbot.addWidget(dlg)
    v = dlg.values()
    assert v["system_prompt"] == "Be kind." and v["temperature"] == 0.3 and v["seed"] == 5
    assert v["overflow"] == "refuse" and v["max_new_tokens"] == DEFAULT_CHAT_SETTINGS["max_new_tokens"]
    dlg.greedy.setChecked(True)
    assert not dlg.temperature.isEnabled()
    dlg.seed.setValue(-1)
    assert dlg.values()["seed"] is None
    assert set(request_fields(dlg.values())) == {"max_new_tokens", "greedy", "temperature", "top_k", "top_p",
                                                 "repetition_penalty", "seed"}


def test_tandem_gui_reaches_the_app(app_data, capsys):
    held = InstanceLock(app_data)
    assert held.acquire() is None
    assert cli_main(["gui", "--data-dir", str(app_data), "--model", "builtin:smollm2-135m"]) == 3
    assert "already running" in capsys.readouterr().err
    held.release()
    assert os.path.isdir(app_data)


def test_style_follows_the_light_or_dark_palette(qtbot):
    from PySide6.QtGui import QColor, QPalette

    from app.main import ASSETS
    from app.theme import DARK, LIGHT, is_dark, style_sheet

    dark = QPalette()
    dark.setColor(QPalette.ColorRole.Window, QColor("#202124"))
    light = QPalette()
    light.setColor(QPalette.ColorRole.Window, QColor("#f0f0f0"))
    assert is_dark(dark) and not is_dark(light)
    for pal, colours in ((dark, DARK), (light, LIGHT)):
        qss = style_sheet(ASSETS / "style.qss", pal)
        assert "$" not in qss and f"background: {colours['bg']}" in qss


def test_code_blocks_have_a_copy_button(qtbot):
    view = MarkdownView()
    qtbot.addWidget(view)
    view.resize(500, 100)
    view.show()
    view.set_text("Two blocks:\n\n```python\nprint(1)\n```\n\nand\n\n```sh\nls -l\n```\n")
    buttons = [b for b in view.copy_buttons if b.isVisibleTo(view)]
    assert [b.code for b in buttons] == ["print(1)", "ls -l"]
    assert buttons[0].y() < buttons[1].y() and buttons[0].x() + buttons[0].width() <= view.viewport().width()
    buttons[1].click()
    assert QGuiApplication.clipboard().text() == "ls -l" and buttons[1].text() == "Copied"
    view.set_text("No code any more.")
    assert not any(b.isVisibleTo(view) for b in view.copy_buttons)


def test_a_redrawn_chat_shows_no_old_cards(qtbot, tmp_path):
    """Switching branches redraws the chat: the old cards leave the layout at once, not at the next idle
    moment (a screenshot once showed every message twice)."""
    from app.chat_view import ChatView

    store = ChatStore(tmp_path / "c.sqlite3")
    chat = store.create_chat()
    store.add_message(chat.id, "user", "Hi")
    store.add_message(chat.id, "assistant", "Hello")
    view = ChatView()
    qtbot.addWidget(view)
    view.set_messages(store.messages(chat.id))
    view.set_messages(store.messages(chat.id))
    cards = [view.vbox.itemAt(i).widget() for i in range(view.vbox.count())]
    assert sum(isinstance(c, MessageWidget) for c in cards) == 2
    store.close()


def test_panels_name_the_profile_without_its_path():
    from app.panels import profile_words

    assert profile_words("/some/where/hw-profile.json (quick, 2026-12-01T19:31:21+00:00)") == \
        "calibrated (quick, 2026-12-01)"
    assert profile_words(None) == "not calibrated"
