"""Chat sessions that keep their KV between turns.

A named chat keeps its sequence in the KV backend and the list of tokens that KV holds (`Session`).
The pool keeps at most max_sessions of them (the KV backend's sequence slots), least recently used
evicted first, never one whose sequence is generating. A new turn resumes a session at the longest
common prefix of what its KV holds and the new prompt: the KV is cropped there and only the rest is
prefilled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping

from engine.kv.backend import KVBackend
from engine.runtime.sequences import Session


class SessionPool(Mapping[str, Session]):
    """The kept sessions by chat key, oldest first; `open` and `end` change it. The KV backend is
    the caller's, passed to each call: a rebuilt backend (engine/runtime/tandem.py) starts after
    every session has ended."""

    def __init__(self, max_sessions: int):
        self.max_sessions = max_sessions
        self._kept: OrderedDict[str, Session] = OrderedDict()  # LRU: oldest first

    def __getitem__(self, key: str) -> Session:
        return self._kept[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._kept)

    def __len__(self) -> int:
        return len(self._kept)

    def open(self, kv: KVBackend, key: str | None, busy: set[int]) -> Session:
        """The named chat's session (most recently used now), or a throwaway one for key None.
        busy: id() of the sessions whose sequence is in the live batch, never the one evicted."""
        if key is not None and key in self._kept:
            self._kept.move_to_end(key)
            return self._kept[key]
        while len(self._kept) >= self.max_sessions:  # the KV pool holds max_sessions sequences
            old = next((k for k, s in self._kept.items() if id(s) not in busy), None)
            if old is None:  # every kept chat is generating now: the pool's free blocks stretch
                break
            kv.free(self._kept.pop(old).seq_id)
        s = Session(kv.new_sequence())
        if key is not None:
            self._kept[key] = s
        return s

    def end(self, kv: KVBackend, key: str) -> None:
        """Forget the chat and free its KV (nothing if it is not kept)."""
        s = self._kept.pop(key, None)
        if s is not None:
            kv.free(s.seq_id)

    def resume(self, kv: KVBackend, s: Session, prompt: list[int]) -> int:
        """Crop s's KV to the longest common prefix of what it holds and `prompt`, at least one token
        short of the prompt (its logits must be computed) and where the backend can resume from
        (kv.resume_point) → the prompt tokens whose KV is kept."""
        common = 0
        for a, b in zip(s.cached, prompt):
            if a != b:
                break
            common += 1
        common = kv.resume_point(s.seq_id, min(common, len(prompt) - 1))
        kv.crop(s.seq_id, common)
        del s.cached[common:]
        return common
