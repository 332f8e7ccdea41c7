"""A reasoning model's reply in the app: its reasoning shown folded above the answer, stored apart
from it (old chat files gain the column and keep their chats), and never sent back to the model.
The end-to-end test runs a tiny gpt-oss with a harmony template, its sampler scripted."""

import sqlite3
from dataclasses import replace

import pytest
from gui_helpers import send_and_wait

from app.chat_view import MessageWidget
from app.conversation import history_dicts
from app.db import SCHEMA_VERSION, ChatStore
from app.export import chat_markdown

THINKING = "The user greets; answer briefly."


def test_a_reply_with_reasoning_shows_it_folded_above_the_answer(qtbot, tmp_path):
    store = ChatStore(tmp_path / "c.sqlite3")
    chat = store.create_chat()
    mid = store.add_message(chat.id, "assistant", "", status="streaming")
    store.finish_message(mid, "Hello there!", {"finish_reason": "stop"}, reasoning=THINKING)
    w = MessageWidget(store.messages(chat.id)[0])
    qtbot.addWidget(w)
    w.show()
    assert w.body.source_text == "Hello there!" and THINKING not in w.body.toPlainText()
    assert w.reasoning.isVisible() and not w.reasoning.text.isVisible()  # folded
    assert w.reasoning.toggle.text() == "Reasoning (5 words)"
    w.reasoning.toggle.click()
    assert w.reasoning.text.isVisible() and w.reasoning.text.text() == THINKING
    plain = MessageWidget(replace(w.message, reasoning=""))
    qtbot.addWidget(plain)
    plain.show()
    assert not plain.reasoning.isVisible()  # a reply without reasoning looks as before
    store.close()


def test_while_the_model_thinks_the_fold_says_so(qtbot, tmp_path):
    store = ChatStore(tmp_path / "c.sqlite3")
    chat = store.create_chat()
    store.add_message(chat.id, "assistant", "", status="streaming")
    w = MessageWidget(store.messages(chat.id)[0])
    qtbot.addWidget(w)
    w.set_reading(10, 40)
    assert w.tag.text() == "reading 10 / 40 tokens…"
    w.refresh("", "Let me see")
    assert w.reasoning.toggle.text() == "Thinking…" and w.tag.text() == "generating…"
    w.refresh("Hi", "Let me see")
    assert w.reasoning.toggle.text() == "Reasoning (3 words)"
    store.close()


def test_history_carries_answers_only():
    store_msgs = [_msg(1, "user", "Hi"), _msg(2, "assistant", "Hello there!", THINKING), _msg(3, "user", "Bye")]
    assert history_dicts(store_msgs) == [{"role": "user", "content": "Hi"},
                                         {"role": "assistant", "content": "Hello there!"},
                                         {"role": "user", "content": "Bye"}]


def test_a_version_2_chat_file_gains_reasoning_and_keeps_its_chats(tmp_path):
    path = tmp_path / "v2.sqlite3"
    conn = sqlite3.connect(path)  # the tree layout of schema 2, as the previous version wrote it
    conn.executescript("""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '2');
        CREATE TABLE chats (id TEXT PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL,
                            settings TEXT NOT NULL DEFAULT '{}', leaf_id INTEGER);
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, chat_id TEXT NOT NULL REFERENCES chats(id)
            ON DELETE CASCADE, role TEXT NOT NULL CHECK (role IN ('user', 'assistant')), content TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'done', stats TEXT, created REAL NOT NULL, parent_id INTEGER);
        INSERT INTO chats VALUES ('c1', 'Old chat', 1, 2, '{}', 3);
        INSERT INTO messages (chat_id, role, content, stats, created, parent_id) VALUES
            ('c1', 'user', 'Hi', NULL, 1, NULL), ('c1', 'assistant', 'Hello', '{"completion_tokens": 3}', 2, 1),
            ('c1', 'user', 'Bye', NULL, 3, 2);
    """)
    conn.close()
    store = ChatStore(path)
    msgs = store.messages("c1")
    assert [(m.role, m.content, m.reasoning) for m in msgs] == [("user", "Hi", ""), ("assistant", "Hello", ""),
                                                               ("user", "Bye", "")]
    assert msgs[1].stats == {"completion_tokens": 3} and [m.parent_id for m in msgs] == [None, 1, 2]
    assert store.conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    reply = store.add_message("c1", "assistant", "", status="streaming")
    store.update_streaming(reply, "So", "thinking")
    store.finish_message(reply, "So long.", None, reasoning="They leave.")
    store.close()
    again = ChatStore(path)  # opening an upgraded file again changes nothing
    assert [(m.content, m.reasoning) for m in again.messages("c1")][-2:] == [("Bye", ""), ("So long.", "They leave.")]
    assert again.integrity() == "ok"
    again.close()


def test_markdown_export_folds_the_reasoning():
    class Chat:
        title, settings = "T", {}

    md = chat_markdown(Chat(), [_msg(1, "assistant", "Hello there!", THINKING)])
    assert md.index("<details><summary>Reasoning</summary>") < md.index(THINKING) < md.index("Hello there!")


@pytest.fixture(scope="module")
def harmony_engine(tmp_path_factory):
    pytest.importorskip("transformers").GptOssConfig  # noqa: B018 — this transformers has gpt-oss
    from harmony_helpers import tiny_gpt_oss_folder

    from engine.api import Engine, EngineConfig

    folder = tiny_gpt_oss_folder(tmp_path_factory.mktemp("gpt-oss") / "m")
    engine = Engine(EngineConfig(model=str(folder), backend="tandem", device="cpu", dtype="float32", max_batch=2))
    yield engine
    engine.close()


def test_a_harmony_reply_end_to_end(qtbot, open_window, harmony_engine, monkeypatch):
    from harmony_helpers import REPLY, script_replies

    script_replies(monkeypatch, REPLY, harmony_engine.tokenizer)
    w = open_window(harmony_engine)
    assert "gpt-oss · " in w.model_label.text() and " parameters" in w.model_label.text()  # what the model is
    sent = []
    generate = w.host.generate
    monkeypatch.setattr(w.host, "generate", lambda job_id, request: (sent.append(request), generate(job_id, request)))
    result = send_and_wait(qtbot, w, "Hi")
    assert result["text"] == "Hello there!" and result["reasoning"] == THINKING
    reply = w.store.messages(w.conv.chat_id)[-1]
    assert (reply.content, reply.reasoning, reply.status) == ("Hello there!", THINKING, "done")
    widget = w.view.widget_for(reply.id)
    assert widget.body.source_text == "Hello there!" and widget.reasoning.text.text() == THINKING
    assert "<|" not in widget.body.toPlainText()
    send_and_wait(qtbot, w, "Bye")
    assert sent[1]["messages"][-2:] == [{"role": "assistant", "content": "Hello there!"},
                                        {"role": "user", "content": "Bye"}]
    assert THINKING not in harmony_engine.tokenizer.decode(harmony_engine.render(sent[1]["messages"]))


def _msg(mid, role, content, reasoning=""):
    from app.db import Message

    return Message(mid, "c", role, content, "done", None, 0.0, mid - 1 or None, reasoning)
