"""Chats, messages, per-message stats and app settings in one SQLite file.

Journal: WAL, so a reader never blocks the writer and a crash mid-write leaves the last committed
state. `synchronous=NORMAL`: in WAL mode a commit is safe against the *process* dying (kill -9,
a crash) because the WAL frames are already in the OS; only a power cut or kernel panic can lose
the last few commits, and even then the file stays consistent. FULL would add an fsync per commit,
and the assistant reply is committed every ~0.5 s while it streams — NORMAL keeps that free.

Branches: a regenerated reply is a sibling of the reply it replaces (same parent, the user message), an
edited message a sibling of the original; nothing is deleted. Each message points at its parent, each
chat at the last message of the branch on screen (`leaf_id`), so the chat shows the path from the root to
that leaf, and ‹ 2/3 › on a message moves the leaf into a sibling's branch. A file of version 1 (a flat
list per chat) is upgraded in place on open: each message's parent is the one before it.

A reasoning model's reply (gpt-oss's harmony analysis channel) keeps its reasoning in `reasoning`,
apart from the answer in `content`: only the answer goes back into later prompts. A file of version 2
gains the column on open, its messages with no reasoning.

The assistant's reply is one row created when generation starts (status 'streaming'), its text
updated in place as it grows and closed with status 'done' and its stats. A row still 'streaming'
when the file is opened was cut off by a crash: it becomes 'interrupted' and keeps the text it had.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA_VERSION = 3  # 2: messages form a tree (parent_id), each chat shows one branch of it (leaf_id); 3: reasoning

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS chats (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    settings TEXT NOT NULL DEFAULT '{}',
    leaf_id INTEGER
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    chat_id TEXT NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'done' CHECK (status IN ('done', 'streaming', 'interrupted', 'error')),
    stats TEXT,
    created REAL NOT NULL,
    parent_id INTEGER,
    reasoning TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS messages_by_chat ON messages (chat_id, id);
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

# Per-chat defaults: what a new chat starts with (the chat settings dialog edits them).
DEFAULT_CHAT_SETTINGS = {
    "system_prompt": "",
    "max_new_tokens": 512,
    "greedy": False,
    "temperature": 0.7,
    "top_k": 0,
    "top_p": 0.95,
    "repetition_penalty": 1.0,
    "seed": None,
    "overflow": "drop_oldest",  # drop_oldest | refuse: what happens when the prompt outgrows the context
}


class StoreError(Exception):
    """The chat file could not be opened or written (disk full, read-only, locked): what and remedy,
    for the window to show without a traceback. What was committed before stays intact."""

    def __init__(self, what: str, remedy: str = ""):
        self.what, self.remedy = what, remedy
        super().__init__(f"{what} — {remedy}" if remedy else what)


def store_error(path: Path, e: sqlite3.Error, doing: str) -> StoreError:
    text = str(e)
    code = getattr(e, "sqlite_errorname", "")
    if code == "SQLITE_FULL" or "disk is full" in text:
        return StoreError(f"{doing} failed: the disk holding {path} is full ({text})",
                          "free some disk space, then try again; the chats saved so far are intact")
    if code.startswith("SQLITE_READONLY") or "readonly" in text or code.startswith("SQLITE_CANTOPEN"):
        return StoreError(f"{doing} failed: {path} cannot be written ({text})",
                          "make the data folder writable, or start Tandem with --data-dir pointing at a "
                          "writable folder; the chats saved so far are intact")
    if code.startswith("SQLITE_BUSY") or "locked" in text:
        return StoreError(f"{doing} failed: {path} is locked by another program ({text})",
                          "close the other program using it (or another Tandem), then try again")
    return StoreError(f"{doing} failed on {path} ({code or type(e).__name__}: {text})",
                      "check the disk and its free space, then try again; the chats saved so far are intact")


def _guarded(doing: str):
    """SQLite errors of a ChatStore method become StoreErrors naming the file and the remedy."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except sqlite3.Error as e:
                raise store_error(self.path, e, doing) from e
        return run
    return wrap


def create_private(path: Path) -> None:
    """Create an empty file readable by its owner only (SQLite's -wal and -shm files copy its mode)."""
    if not path.exists():
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))


@dataclass
class Chat:
    id: str
    title: str
    created: float
    updated: float
    settings: dict = field(default_factory=dict)


@dataclass
class Message:
    id: int
    chat_id: str
    role: str
    content: str
    status: str
    stats: dict | None
    created: float
    parent_id: int | None = None  # the message it follows (None: the chat's first)
    reasoning: str = ""  # a reasoning model's thinking before its answer (never sent back to the model)


class ChatStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.conn = None
        try:
            create_private(self.path)
        except OSError as e:
            raise StoreError(f"opening the chats failed: {self.path} cannot be created ({e.strerror or e})",
                             "make the data folder writable, or start Tandem with --data-dir pointing at a "
                             "writable folder") from e
        self._open()

    @_guarded("opening the chats")
    def _open(self) -> None:
        # isolation_level=None: autocommit; multi-statement changes open their own transaction.
        self.conn = sqlite3.connect(str(self.path), isolation_level=None, timeout=5.0)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA foreign_keys=ON")
        self.conn.executescript(SCHEMA)
        self._upgrade()
        self.conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        self.recovered = self.conn.execute(
            "UPDATE messages SET status='interrupted' WHERE status='streaming'").rowcount

    def _upgrade(self) -> None:
        cols = {r["name"] for r in self.conn.execute("PRAGMA table_info(messages)")}
        if "parent_id" not in cols:
            self._upgrade_to_tree()
        if "reasoning" not in cols:  # version 2 → 3: every old message had no reasoning apart
            with self.conn:
                self.conn.execute("BEGIN")
                self.conn.execute("ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''")
                self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))

    def _upgrade_to_tree(self) -> None:
        """Version 1 → 2: add the tree's columns and chain each chat's messages in their order."""
        with self.conn:
            self.conn.execute("BEGIN")
            self.conn.execute("ALTER TABLE messages ADD COLUMN parent_id INTEGER")
            self.conn.execute("ALTER TABLE chats ADD COLUMN leaf_id INTEGER")
            self.conn.execute("UPDATE messages SET parent_id = (SELECT max(p.id) FROM messages p "
                              "WHERE p.chat_id = messages.chat_id AND p.id < messages.id)")
            self.conn.execute("UPDATE chats SET leaf_id = (SELECT max(id) FROM messages WHERE chat_id = chats.id)")
            self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    # -- chats ----------------------------------------------------------------------------------
    @_guarded("saving a new chat")
    def create_chat(self, title: str = "New chat", settings: dict | None = None) -> Chat:
        now = time.time()
        chat = Chat(uuid.uuid4().hex, title, now, now, {**DEFAULT_CHAT_SETTINGS, **(settings or {})})
        self.conn.execute("INSERT INTO chats (id, title, created, updated, settings) VALUES (?, ?, ?, ?, ?)",
                          (chat.id, chat.title, now, now, json.dumps(chat.settings)))
        return chat

    def _chat(self, row) -> Chat:
        return Chat(row["id"], row["title"], row["created"], row["updated"],
                    {**DEFAULT_CHAT_SETTINGS, **json.loads(row["settings"] or "{}")})

    def chat(self, chat_id: str) -> Chat | None:
        row = self.conn.execute("SELECT * FROM chats WHERE id=?", (chat_id,)).fetchone()
        return self._chat(row) if row else None

    def chats(self, search: str = "") -> list[Chat]:
        """Newest first; `search` matches the title or any message's text (case-insensitive)."""
        if not search:
            rows = self.conn.execute("SELECT * FROM chats ORDER BY updated DESC")
        else:
            like = "%" + search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            rows = self.conn.execute(
                "SELECT * FROM chats WHERE title LIKE ?1 ESCAPE '\\' OR id IN "
                "(SELECT chat_id FROM messages WHERE content LIKE ?1 ESCAPE '\\') ORDER BY updated DESC", (like,))
        return [self._chat(r) for r in rows]

    def untouched_chat(self) -> Chat | None:
        """The newest chat nobody has written in or renamed yet (None when there is none)."""
        row = self.conn.execute("SELECT * FROM chats WHERE title='New chat' AND NOT EXISTS "
                                "(SELECT 1 FROM messages WHERE chat_id=chats.id) ORDER BY updated DESC LIMIT 1").fetchone()
        return self._chat(row) if row else None

    @_guarded("renaming the chat")
    def rename_chat(self, chat_id: str, title: str) -> None:
        self.conn.execute("UPDATE chats SET title=? WHERE id=?", (title.strip() or "Untitled", chat_id))

    @_guarded("saving the chat's settings")
    def set_chat_settings(self, chat_id: str, settings: dict) -> None:
        self.conn.execute("UPDATE chats SET settings=? WHERE id=?", (json.dumps(settings), chat_id))

    @_guarded("deleting the chat")
    def delete_chat(self, chat_id: str) -> None:
        self.conn.execute("DELETE FROM chats WHERE id=?", (chat_id,))  # messages go by ON DELETE CASCADE

    def _touch(self, chat_id: str) -> None:
        self.conn.execute("UPDATE chats SET updated=? WHERE id=?", (time.time(), chat_id))

    # -- messages -------------------------------------------------------------------------------
    def _message(self, r) -> Message:
        return Message(r["id"], r["chat_id"], r["role"], r["content"], r["status"],
                       json.loads(r["stats"]) if r["stats"] else None, r["created"], r["parent_id"], r["reasoning"])

    def leaf(self, chat_id: str) -> int | None:
        row = self.conn.execute("SELECT leaf_id FROM chats WHERE id=?", (chat_id,)).fetchone()
        return row["leaf_id"] if row else None

    def messages(self, chat_id: str) -> list[Message]:
        """The branch on screen: from the first message to the chat's leaf, in order."""
        leaf = self.leaf(chat_id)
        if leaf is None:
            return []
        rows = self.conn.execute(
            "WITH RECURSIVE path(id) AS (SELECT ?1 UNION ALL SELECT m.parent_id FROM messages m JOIN path "
            "ON m.id = path.id WHERE m.parent_id IS NOT NULL) "
            "SELECT * FROM messages WHERE chat_id=?2 AND id IN (SELECT id FROM path) ORDER BY id", (leaf, chat_id))
        return [self._message(r) for r in rows]

    def siblings(self, message: Message) -> list[int]:
        """The alternatives at this message's place (itself included), oldest first."""
        rows = self.conn.execute("SELECT id FROM messages WHERE chat_id=? AND parent_id IS ? ORDER BY id",
                                 (message.chat_id, message.parent_id))
        return [r["id"] for r in rows]

    def branches(self, messages: list[Message]) -> dict[int, tuple[int, int]]:
        """message id → (its 1-based place, how many alternatives) for those that have alternatives."""
        out = {}
        for m in messages:
            sib = self.siblings(m)
            if len(sib) > 1:
                out[m.id] = (sib.index(m.id) + 1, len(sib))
        return out

    @_guarded("switching branches")
    def show_branch(self, chat_id: str, message_id: int | None) -> None:
        """Show the branch through `message_id`: it and, below it, the newest reply at each step."""
        leaf = message_id
        while leaf is not None:
            row = self.conn.execute("SELECT max(id) AS id FROM messages WHERE chat_id=? AND parent_id=?",
                                    (chat_id, leaf)).fetchone()
            if row["id"] is None:
                break
            leaf = row["id"]
        self.conn.execute("UPDATE chats SET leaf_id=? WHERE id=?", (leaf, chat_id))

    @_guarded("switching branches")
    def show_branch_end(self, chat_id: str, message_id: int | None) -> None:
        """End the branch on screen at `message_id` (None: before the first message), so that the next
        message added there starts a new alternative beside the ones that follow it."""
        self.conn.execute("UPDATE chats SET leaf_id=? WHERE id=?", (message_id, chat_id))

    @_guarded("saving the message")
    def add_message(self, chat_id: str, role: str, content: str, status: str = "done",
                    stats: dict | None = None, parent_id: int | None | str = "leaf") -> int:
        """A message after `parent_id` (default: the end of the branch on screen), which it then ends."""
        with self.conn:  # one transaction: the message, the chat's leaf and its new timestamp together
            self.conn.execute("BEGIN")
            if parent_id == "leaf":
                parent_id = self.leaf(chat_id)
            cur = self.conn.execute(
                "INSERT INTO messages (chat_id, role, content, status, stats, created, parent_id) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (chat_id, role, content, status, json.dumps(stats) if stats else None, time.time(), parent_id))
            self.conn.execute("UPDATE chats SET leaf_id=? WHERE id=?", (cur.lastrowid, chat_id))
            self._touch(chat_id)
        return cur.lastrowid

    @_guarded("saving the reply")
    def update_streaming(self, message_id: int, content: str, reasoning: str = "") -> None:
        """The reply so far: one small autocommitted UPDATE (a crash keeps the last one written)."""
        self.conn.execute("UPDATE messages SET content=?, reasoning=? WHERE id=? AND status='streaming'",
                          (content, reasoning, message_id))

    @_guarded("saving the reply")
    def finish_message(self, message_id: int, content: str, stats: dict | None, status: str = "done",
                       reasoning: str = "") -> None:
        self.conn.execute("UPDATE messages SET content=?, reasoning=?, stats=?, status=? WHERE id=?",
                          (content, reasoning, json.dumps(stats) if stats else None, status, message_id))

    # -- settings -------------------------------------------------------------------------------
    def setting(self, key: str, default=None):
        row = self.conn.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return json.loads(row["value"]) if row else default

    @_guarded("saving a setting")
    def set_setting(self, key: str, value) -> None:
        self.conn.execute("INSERT INTO settings VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                          (key, json.dumps(value)))

    def integrity(self) -> str:
        return self.conn.execute("PRAGMA integrity_check").fetchone()[0]
