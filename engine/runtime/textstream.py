"""Incremental detokenisation with stop strings.

Text is emitted only once it cannot change: not while the tail is an incomplete UTF-8 sequence
(U+FFFD) and not while it could still be the start of a stop string.

A harmony model's reply (gpt-oss) is decoded with its special tokens, which mark its channels, and
split by engine/runtime/harmony.py into answer (`str`) and reasoning (`Reasoning`) pieces.
"""

from __future__ import annotations

from engine.runtime.harmony import HarmonyParser, uses_harmony


class TextStream:
    def __init__(self, tokenizer, stop_strings: list[str] | None = None, harmony: bool = False):
        self.tokenizer = tokenizer
        self.stops = [s for s in (stop_strings or []) if s]
        self.parser = HarmonyParser() if harmony else None
        self.ids: list[int] = []
        self.decoded = ""  # final decoded text so far (after a stop: cut before the stop string)
        self.emitted = 0  # characters of self.decoded already handed out
        self.stopped = False

    @classmethod
    def for_request(cls, tokenizer, request) -> TextStream:
        """The stream for one request: a chat reply of a harmony model is split into its channels;
        raw text (a completion of the caller's own text) streams as decoded, markup left out."""
        return cls(tokenizer, request.stop, harmony=not request.raw and uses_harmony(tokenizer))

    @property
    def text(self) -> str:
        """The answer so far (a harmony reply's final channel)."""
        return self.parser.answer if self.parser else self.decoded

    @property
    def reasoning(self) -> str:
        return self.parser.reasoning if self.parser else ""

    def add(self, token_id: int) -> list[str]:
        """Feed one token; returns the pieces of text that became final (often none)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.parser is None)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.decoded, self.stopped = text[:cut], True
            return self._emit(len(self.decoded)) + self._parser_finish()
        self.decoded = text
        if text.endswith("\ufffd"):
            return []
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._emit(len(text) - hold)

    def finish(self) -> list[str]:
        """The end of generation: whatever was held back is final now."""
        upto = len(self.decoded.rstrip("\ufffd")) if not self.stopped else len(self.decoded)
        return self._emit(upto) + self._parser_finish()

    def _parser_finish(self) -> list[str]:
        return self.parser.finish() if self.parser else []

    def _emit(self, upto: int) -> list[str]:
        if upto <= self.emitted or (self.parser and self.parser.done):
            return []
        out, self.emitted = self.decoded[self.emitted:upto], upto
        if self.parser is None:
            return [out]
        pieces = self.parser.feed(out)
        if self.parser.done:  # <|return|> or <|call|> (when they are not the model's end tokens)
            self.stopped = True
        return pieces
