"""What of a chat goes to the model: the context budget, the overflow policy, attached files.

The prompt is the system prompt, the history and the new message, rendered by the model's own chat
template (`Engine.render`) and counted in tokens. It must leave room for the reply:
limit = max_context − reply_reserve. When it does not fit, the chat's policy decides, and the UI
says which: `drop_oldest` leaves out the oldest whole turns (the chat view marks them and a notice
says how many), `refuse` sends nothing and says why. Nothing is ever cut silently, and the system
prompt and the new message are never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

POLICIES = {"drop_oldest": "Leave out the oldest turns (marked in the chat)",
            "refuse": "Refuse to send and say so"}

MAX_ATTACHMENT_BYTES = 2 * 2**20  # a plain-text file larger than 2 MiB is surely not meant for a prompt

# File suffix → the language tag of the fenced block the file is quoted in.
FENCE_LANG = {".py": "python", ".md": "markdown", ".js": "javascript", ".ts": "typescript", ".c": "c",
              ".h": "c", ".cpp": "cpp", ".hpp": "cpp", ".rs": "rust", ".go": "go", ".java": "java",
              ".sh": "sh", ".json": "json", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml",
              ".html": "html", ".css": "css", ".sql": "sql", ".rb": "ruby", ".txt": ""}


def reply_reserve(max_context: int, max_new_tokens: int) -> int:
    """Tokens kept free for the answer: the chat's reply length, but at most a quarter of the window."""
    return max(1, min(int(max_new_tokens), max_context // 4))


@dataclass
class ContextPlan:
    tokens: int  # prompt tokens of what will be sent
    full_tokens: int  # prompt tokens of the whole chat (equal to tokens unless turns are dropped)
    limit: int  # max_context − reply reserve
    max_context: int
    dropped: int  # history messages left out (oldest first)
    action: str  # "ok" | "drop" | "refuse"

    @property
    def fits(self) -> bool:
        return self.action != "refuse"

    def describe(self) -> str:
        if self.action == "ok":
            return f"{self.tokens:,} / {self.max_context:,} tokens"
        if self.action == "drop":
            return (f"{self.full_tokens:,} tokens > limit {self.limit:,}: the oldest {self.dropped} "
                    f"message{'s' if self.dropped != 1 else ''} will be left out ({self.tokens:,} sent)")
        return (f"{self.full_tokens:,} tokens > limit {self.limit:,} (context {self.max_context:,} − reply room): "
                "will not send — shorten the message, start a new chat or allow dropping old turns")


def build_messages(system_prompt: str, history: list[dict], draft: str | None) -> list[dict]:
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
    msgs += [{"role": m["role"], "content": m["content"]} for m in history]
    if draft is not None:
        msgs.append({"role": "user", "content": draft})
    return msgs


def plan_context(render: Callable[[list[dict]], list[int]], system_prompt: str, history: list[dict],
                 draft: str | None, max_context: int, max_new_tokens: int, policy: str) -> ContextPlan:
    """Count the prompt and apply the overflow policy. `history` alternates user/assistant turns."""
    limit = max_context - reply_reserve(max_context, max_new_tokens)
    messages = build_messages(system_prompt, history, draft)
    if not messages:  # a new chat with an empty box: nothing to send is 0 tokens (templates refuse [])
        return ContextPlan(0, 0, limit, max_context, 0, "ok")
    full = len(render(messages))
    if full <= limit:
        return ContextPlan(full, full, limit, max_context, 0, "ok")
    if policy != "drop_oldest":
        return ContextPlan(full, full, limit, max_context, 0, "refuse")
    # Cut points at user messages, so a turn (user + its reply) leaves together. The count shrinks as
    # more is dropped, so binary-search the fewest turns to drop: O(log n) renders, not O(n).
    cuts = [i for i, m in enumerate(history) if m["role"] == "user" and i > 0] + [len(history)]
    lo, hi = 0, len(cuts) - 1
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        n = len(render(build_messages(system_prompt, history[cuts[mid]:], draft)))
        if n <= limit:
            best, hi = (cuts[mid], n), mid - 1
        else:
            lo = mid + 1
    if best is None:  # even the system prompt and the new message alone are too long
        return ContextPlan(full, full, limit, max_context, 0, "refuse")
    return ContextPlan(best[1], full, limit, max_context, best[0], "drop")


@dataclass
class Attachment:
    name: str
    text: str
    tokens: int | None = None  # counted by the engine's tokenizer once the worker answers

    def as_prompt(self) -> str:
        lang = FENCE_LANG.get(Path(self.name).suffix.lower(), "")
        fence = "````" if "```" in self.text else "```"
        return f"File `{self.name}`:\n{fence}{lang}\n{self.text.rstrip()}\n{fence}"


class AttachmentError(ValueError):
    pass


def read_text_file(path: str | Path) -> Attachment:
    """A plain-text file (UTF-8, or UTF-16 with a BOM) as an attachment; binary files are refused."""
    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError as e:
        raise AttachmentError(f"{p.name}: cannot be read ({e.strerror})") from e
    if size > MAX_ATTACHMENT_BYTES:
        raise AttachmentError(f"{p.name}: {size / 2**20:.1f} MiB is too large for a prompt (limit 2 MiB)")
    data = p.read_bytes()
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        text = data.decode("utf-16")
    else:
        if b"\x00" in data:
            raise AttachmentError(f"{p.name}: looks like a binary file; attach plain text (text, Markdown, code)")
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise AttachmentError(f"{p.name}: is not UTF-8 text ({e.reason} at byte {e.start})") from e
    return Attachment(p.name, text)


def compose_message(text: str, attachments: list[Attachment]) -> str:
    parts = [text.strip()] if text.strip() else []
    parts += [a.as_prompt() for a in attachments]
    return "\n\n".join(parts)
