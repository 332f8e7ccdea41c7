"""SessionPool (engine/runtime/sessions.py) over a real KV backend: at most max_sessions chats keep
their KV, the least recently used goes first but never a generating one, and a new turn resumes at
the common prefix of the kept tokens and the new prompt."""

import torch

from engine.kv.monolithic import MonolithicKV
from engine.runtime.sessions import SessionPool


def _kv(max_batch):
    return MonolithicKV(1, 1, 8, max_context=16, max_batch=max_batch, device=torch.device("cpu"),
                        dtype=torch.float32)


def test_the_least_recently_used_idle_chat_is_evicted():
    kv = _kv(3)
    pool = SessionPool(max_sessions=2)
    a, b = pool.open(kv, "a", busy=set()), pool.open(kv, "b", busy=set())
    assert pool.open(kv, "a", busy=set()) is a  # a is now the most recently used
    c = pool.open(kv, "c", busy=set())
    assert list(pool) == ["a", "c"] and pool["c"] is c
    assert b.seq_id not in kv.lengths  # its KV sequence is freed
    d = pool.open(kv, "d", busy={id(a)})  # a generates: c goes, though a is older
    assert list(pool) == ["a", "d"] and pool["d"] is d and c.seq_id not in kv.lengths


def test_every_chat_generating_stretches_the_pool_and_a_throwaway_is_not_kept():
    kv = _kv(4)
    pool = SessionPool(max_sessions=1)
    a = pool.open(kv, "a", busy=set())
    b = pool.open(kv, "b", busy={id(a)})
    assert list(pool) == ["a", "b"]
    pool.open(kv, None, busy={id(b)})  # back within max_sessions as chats go idle; nothing kept under no key
    assert list(pool) == ["b"] and b is pool["b"]
    pool.end(kv, "b")
    pool.end(kv, "never-opened")
    assert len(pool) == 0


def test_a_new_turn_resumes_at_the_common_prefix():
    kv = _kv(1)
    pool = SessionPool(max_sessions=1)
    s = pool.open(kv, "a", busy=set())
    s.cached.extend([5, 6, 7, 8])
    kv.lengths[s.seq_id] = 4  # as after a turn that stored those four tokens
    assert pool.resume(kv, s, [5, 6, 9, 9, 9]) == 2
    assert s.cached == [5, 6] and kv.length(s.seq_id) == 2
    assert pool.resume(kv, s, [5, 6]) == 1  # the same prompt again: its last token is computed for logits
    assert s.cached == [5] and kv.length(s.seq_id) == 1
