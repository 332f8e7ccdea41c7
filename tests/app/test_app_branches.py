"""Regenerate and edit keep what they replace: ‹ 2/3 › on the message, saved in SQLite across restarts."""

import sqlite3

from gui_helpers import REPLY_TIMEOUT_MS, send_and_wait, set_chat

from app.db import SCHEMA_VERSION, ChatStore


def _regenerate(qtbot, w):
    with qtbot.waitSignal(w.conv.reply_finished, timeout=REPLY_TIMEOUT_MS) as done:
        w.view.widgets[-1].regen_btn.click()
    return done.args[1]


def test_regenerate_keeps_alternatives_across_restart(qtbot, open_window):
    w = open_window()
    set_chat(w, greedy=False, temperature=1.2, max_new_tokens=8)
    texts = [send_and_wait(qtbot, w, "Name a colour.")["text"]]
    texts += [_regenerate(qtbot, w)["text"], _regenerate(qtbot, w)["text"]]
    chat = w.conv.chat_id
    reply = w.view.widgets[-1]
    assert [m.role for m in w.store.messages(chat)] == ["user", "assistant"]  # one branch on screen
    assert reply.branch == (3, 3) and reply.branch_label.text() == "3/3" and reply.body.source_text == texts[2]
    assert reply.prev_btn.isEnabled() and not reply.next_btn.isEnabled()
    reply.prev_btn.click()
    reply = w.view.widgets[-1]
    assert reply.branch == (2, 3) and reply.body.source_text == texts[1]
    assert reply.next_btn.isEnabled()
    w.close()
    w.store.close()

    w2 = open_window()  # after a restart: the same chat, on the branch that was on screen
    assert w2.conv.chat_id == chat
    reply = w2.view.widgets[-1]
    assert reply.branch == (2, 3) and reply.body.source_text == texts[1]
    reply.prev_btn.click()
    assert w2.view.widgets[-1].body.source_text == texts[0]


def test_edit_branches_and_the_original_stays(qtbot, open_window):
    w = open_window()
    set_chat(w, greedy=True, max_new_tokens=6)
    first = send_and_wait(qtbot, w, "What is the capital of Italy?")
    user = w.view.widgets[0]
    user.edit_btn.click()
    user.edit_box.setPlainText("What is the capital of France?")
    with qtbot.waitSignal(w.conv.reply_finished, timeout=REPLY_TIMEOUT_MS):
        user._submit_edit()
    user = w.view.widgets[0]
    assert user.branch == (2, 2) and "France" in user.body.source_text
    assert "Paris" in w.view.widgets[1].body.source_text
    user.prev_btn.click()  # back to the original question, with its own reply below it
    assert "Italy" in w.view.widgets[0].body.source_text
    assert w.view.widgets[1].body.source_text == first["text"]
    assert len(w.store.conn.execute("SELECT id FROM messages WHERE chat_id=?", (w.conv.chat_id,)).fetchall()) == 4


def test_a_version_1_chat_file_is_upgraded_in_place(tmp_path):
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)  # the flat layout of schema 1, as older versions wrote it
    conn.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        CREATE TABLE chats (id TEXT PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL,
                            settings TEXT NOT NULL DEFAULT '{}');
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, chat_id TEXT NOT NULL REFERENCES chats(id)
            ON DELETE CASCADE, role TEXT NOT NULL, content TEXT NOT NULL, status TEXT NOT NULL DEFAULT 'done',
            stats TEXT, created REAL NOT NULL);
        INSERT INTO chats VALUES ('c1', 'Old chat', 1, 2, '{}');
        INSERT INTO messages (chat_id, role, content, created) VALUES ('c1', 'user', 'Hi', 1), ('c1', 'assistant', 'Hello', 2),
            ('c1', 'user', 'Bye', 3);
    """)
    conn.close()
    store = ChatStore(path)
    msgs = store.messages("c1")
    assert [m.content for m in msgs] == ["Hi", "Hello", "Bye"]
    assert [m.parent_id for m in msgs] == [None, msgs[0].id, msgs[1].id]
    assert store.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    assert store.integrity() == "ok"
    store.close()
