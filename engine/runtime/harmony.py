"""gpt-oss's harmony output format, parsed as it streams: reasoning apart from the answer.

A harmony model answers in messages, each a header and a body:

    <|channel|>analysis<|message|>…reasoning…<|end|><|start|>assistant<|channel|>final<|message|>…answer…<|return|>

The `analysis` channel is the model's chain of thought and `commentary` its preambles and tool
calls: both are reasoning, shown apart and never fed back as the answer. `final` is the answer.
`<|return|>` ends the reply, `<|call|>` ends it at a tool call. The chat template's generation
prompt ends with `<|start|>assistant`, so a reply starts inside a header.

Text arrives in arbitrary pieces (a detokeniser's deltas), so a marker can be split across two
of them: the tail that could still be the start of a marker is held back until it is known.
"""

from __future__ import annotations

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
REASONING_CHANNELS = {"analysis", "commentary"}
# A header holds a role, a channel name and a recipient: a few words. Longer text outside any
# message is a model that ignores the format, and is shown as its answer rather than swallowed.
HEADER_LIMIT = 128


class Reasoning(str):
    """A piece of a reply's reasoning (the analysis or commentary channel), not of its answer.

    Streams hand out answer text as plain `str` and reasoning as `Reasoning`, so a caller that
    shows them apart tells them by type and one that does not still receives text."""


def uses_harmony(tokenizer) -> bool:
    """Whether the model's chat template is harmony's (its replies then carry channel markup)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates (default, tool_use, …)
        template = "".join(str(t) for t in template.values())
    return CHANNEL in str(template)


class HarmonyParser:
    def __init__(self):
        self.answer = ""
        self.reasoning = ""
        self.done = False  # <|return|> or <|call|> came: the reply is over
        self._pending = ""  # text not yet placed: it could still begin a marker
        self._state = "header"  # header | channel | constrain | body
        self._header = ""  # header text since the last marker (role, recipient)
        self._channel_name = ""
        self._to_reasoning = False  # the open message's channel
        self._opened = False  # a message body was ever opened

    def feed(self, text: str) -> list[str]:
        """The pieces that became known: `Reasoning` for reasoning, `str` for the answer."""
        if self.done or not text:
            return []
        self._pending += text
        out: list[str] = []
        while self._pending and not self.done:
            at, marker = _first_marker(self._pending)
            if marker is None:
                hold = _partial_marker_len(self._pending)
                ready, self._pending = self._pending[:len(self._pending) - hold], self._pending[len(self._pending) - hold:]
                self._place(ready, out)
                break
            self._place(self._pending[:at], out)
            self._pending = self._pending[at + len(marker):]
            self._mark(marker)
        return out

    def finish(self) -> list[str]:
        """The end of the text: a held-back tail is text after all."""
        out: list[str] = []
        if not self.done:
            tail, self._pending = self._pending, ""
            self._place(tail, out)
            if not self._opened and self._header.strip():  # a reply without any markup: all of it is the answer
                self._emit(self._header, False, out)
            self._header = ""
        return out

    def _mark(self, marker: str) -> None:
        if marker in (RETURN, CALL):
            self.done = True
            self._pending = ""
        elif marker in (START, END):  # a new message: the last one's channel is not this one's
            self._state, self._header, self._channel_name = "header", "", ""
        elif marker == CHANNEL:
            self._state, self._channel_name = "channel", ""
        elif marker == CONSTRAIN:  # `<|constrain|>json`: the tool call's format, not text
            self._state = "constrain"
        elif marker == MESSAGE:
            name = self._channel_name.split()[0] if self._channel_name.split() else "final"
            self._state, self._to_reasoning, self._opened = "body", name in REASONING_CHANNELS, True
            self._header = ""

    def _place(self, text: str, out: list[str]) -> None:
        if not text:
            return
        if self._state == "body":
            self._emit(text, self._to_reasoning, out)
        elif self._state == "channel":
            self._channel_name += text
        elif self._state == "header":
            self._header += text
            if len(self._header) > HEADER_LIMIT:  # not a header: text outside the format is the answer
                self._state, self._to_reasoning, self._opened = "body", False, True
                self._emit(self._header, False, out)
                self._header = ""

    def _emit(self, text: str, to_reasoning: bool, out: list[str]) -> None:
        if to_reasoning:
            self.reasoning += text
            piece = Reasoning(text)
        else:
            self.answer += text
            piece = text
        if out and type(out[-1]) is type(piece):  # one piece per run of one kind
            out[-1] = type(piece)(out[-1] + piece)
        else:
            out.append(piece)


def _first_marker(text: str) -> tuple[int, str | None]:
    at = text.find("<|")
    while at >= 0:
        marker = next((m for m in MARKERS if text.startswith(m, at)), None)
        if marker is not None:
            return at, marker
        at = text.find("<|", at + 1)
    return -1, None


def _partial_marker_len(text: str) -> int:
    """How many characters at the end of `text` could be the beginning of a marker."""
    return max((k for m in MARKERS for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
