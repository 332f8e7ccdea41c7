"""Exports: the session's StatsSnapshot timeline (JSON, CSV), a chat (Markdown, JSON), the panels (PNG)."""

from __future__ import annotations

import csv
import json
import os
import time
from collections import deque
from pathlib import Path

from app.chat_view import format_stats

TIMELINE_CAP = 20000  # records kept in memory: ~2.8 h of idle sampling at 2 Hz, far more while chatting


def flatten(d: dict, prefix: str = "") -> dict:
    """{'vram': {'weights': 1}} → {'vram.weights': 1}; lists and scalars stay as they are."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class StatsTimeline:
    """Every snapshot the app received this session, oldest first (the oldest drop past the cap)."""

    def __init__(self, cap: int = TIMELINE_CAP):
        self.records: deque[dict] = deque(maxlen=cap)
        self.started = time.time()

    def add(self, snap: dict) -> None:
        self.records.append(snap)

    def __len__(self) -> int:
        return len(self.records)

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        doc = {"format": "tandem-stats-timeline/1", "session_started": self.started, "records": list(self.records)}
        _write_private(path, json.dumps(doc, indent=1))
        return path

    def write_csv(self, path: str | Path) -> Path:
        """One row per snapshot, one column per leaf field (dotted names); null is an empty cell."""
        path = Path(path)
        rows = [flatten(r) for r in self.records]
        columns: list[str] = []
        for r in rows:
            columns += [c for c in r if c not in columns]
        if "t" in columns:
            columns.remove("t")
            columns.insert(0, "t")
        with open(path, "w", newline="", opener=_owner_only) as f:
            w = csv.DictWriter(f, fieldnames=columns, restval="")
            w.writeheader()
            for r in rows:
                w.writerow({k: ("" if v is None else v) for k, v in r.items()})
        return path


def _owner_only(path, flags: int) -> int:
    """open()'s opener: a new file is created readable by its owner only (chats are private)."""
    return os.open(path, flags, 0o600)


def _write_private(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8", opener=_owner_only) as f:
        f.write(text)


def chat_markdown(chat, messages) -> str:
    lines = [f"# {chat.title}", ""]
    if chat.settings.get("system_prompt"):
        lines += ["**System prompt:**", "", chat.settings["system_prompt"], ""]
    for m in messages:
        who = "You" if m.role == "user" else "Assistant"
        note = {"interrupted": " (interrupted)", "error": " (failed)", "streaming": " (incomplete)"}.get(m.status, "")
        lines += [f"## {who}{note}", ""]
        if m.reasoning:  # folded as in the chat: GitHub and most viewers render <details> closed
            lines += ["<details><summary>Reasoning</summary>", "", m.reasoning, "", "</details>", ""]
        lines += [m.content, ""]
        if m.role == "assistant" and m.stats and m.status != "error":
            lines += [f"*{format_stats(m.stats)}*", ""]
    return "\n".join(lines)


def write_chat_markdown(path: str | Path, chat, messages) -> Path:
    path = Path(path)
    _write_private(path, chat_markdown(chat, messages))
    return path


def write_chat_json(path: str | Path, chat, messages, model: str | None = None) -> Path:
    path = Path(path)
    doc = {"format": "tandem-chat/1", "id": chat.id, "title": chat.title, "created": chat.created,
           "updated": chat.updated, "settings": chat.settings, "model": model,
           "messages": [{"role": m.role, "content": m.content, "status": m.status, "stats": m.stats,
                         "created": m.created, **({"reasoning": m.reasoning} if m.reasoning else {})}
                        for m in messages]}
    _write_private(path, json.dumps(doc, indent=1, ensure_ascii=False))
    return path


def write_panels_png(path: str | Path, widget) -> Path:
    path = Path(path)
    if not widget.grab().save(str(path), "PNG"):
        raise OSError(f"could not write {path}")
    os.chmod(path, 0o600)
    return path
