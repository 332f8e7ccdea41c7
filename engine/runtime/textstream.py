"""Incremental detokenisation with stop strings.

Text is emitted only once it cannot change: not while the tail is an incomplete UTF-8 sequence
(U+FFFD) and not while it could still be the start of a stop string.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop_strings: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stops = [s for s in (stop_strings or []) if s]
        self.ids: list[int] = []
        self.text = ""  # final text so far (after a stop: cut before the stop string)
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Feed one token; returns the text that became final (possibly empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._emit(len(self.text))
        self.text = text
        if text.endswith("\ufffd"):
            return ""
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._emit(len(text) - hold)

    def finish(self) -> str:
        """The end of generation: whatever was held back is final now."""
        return self._emit(len(self.text.rstrip("\ufffd")) if not self.stopped else len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted:upto], upto
        return out
