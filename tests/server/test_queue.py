"""The queue that shares one engine between requests: waiting, refusing when full, cancelling, and
the continuous batch behind it (joining between steps, leaving alone, failing alone)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from engine.api import GenerationRequest
from engine.server.queue import EngineQueue, QueueFullError


async def events_of(job, timeout_s: float = 60.0) -> list:
    events = []
    while not events or events[-1][0] not in ("done", "error"):
        events.append(await asyncio.wait_for(job.events.get(), timeout_s))
    return events


def test_queue_refuses_when_full_and_cancels_waiting_and_running_jobs(dense_engine):
    async def main():
        q = EngineQueue(dense_engine, max_pending=2, batch_size=1)  # one at a time: the others must wait
        try:
            long = q.submit(GenerationRequest(prompt="Once upon a time", raw=True, max_new_tokens=500,
                                              ignore_eos=True))
            kind, _ = await asyncio.wait_for(long.events.get(), 60)
            assert kind == "text" and q.stats()["running"] == 1
            waiting = q.submit(GenerationRequest(prompt="Hello", raw=True, max_new_tokens=4))
            last = q.submit(GenerationRequest(prompt="1, 2, 3,", raw=True, max_new_tokens=3, greedy=True))
            with pytest.raises(QueueFullError):
                q.submit(GenerationRequest(prompt="one too many", raw=True))
            assert q.stats()["rejected"] == 1 and q.stats()["queued"] == 2
            waiting.cancel()  # never starts
            long.cancel()  # stops at its next step
            events = await events_of(last)
            assert events[-1][0] == "done" and events[-1][1].completion_tokens == 3
            assert "".join(v for k, v in events if k == "text") == events[-1][1].text
            return q.stats()
        finally:
            q.close()

    stats = asyncio.run(main())
    outcomes = {r["id"]: r for r in stats["recent"]}
    assert outcomes[1]["outcome"] == "cancelled" and outcomes[1]["finish_reason"] == "stopped"
    assert outcomes[1]["completion_tokens"] < 200  # the engine stopped long before 500
    assert outcomes[2]["outcome"] == "cancelled" and "completion_tokens" not in outcomes[2]  # skipped
    assert outcomes[3]["outcome"] == "completed"


def test_jobs_join_a_running_batch_and_leave_it_alone(dense_engine):
    """B joins while A decodes, C joins later; B is cancelled mid-way: A and C still produce exactly
    what each produces alone (greedy), and B's cancel stops only B."""
    a = GenerationRequest(prompt="1, 2, 3, 4,", raw=True, max_new_tokens=40, greedy=True, ignore_eos=True)
    b = GenerationRequest(prompt="Once upon a time", raw=True, max_new_tokens=500, ignore_eos=True)
    c = GenerationRequest(prompt="The capital of France is", raw=True, max_new_tokens=12, greedy=True,
                          ignore_eos=True)
    alone = {id(r): dense_engine.generate(r).token_ids for r in (a, c)}

    async def main():
        q = EngineQueue(dense_engine)
        try:
            ja = q.submit(a)
            await asyncio.wait_for(ja.events.get(), 60)  # A is decoding
            jb = q.submit(b)
            await asyncio.wait_for(jb.events.get(), 60)  # B has joined: its first text is out
            jc = q.submit(c)
            ec = await events_of(jc)
            jb.cancel()
            ea, eb = await events_of(ja), await events_of(jb)
            return ea[-1][1], eb[-1][1], ec[-1][1], q.stats()
        finally:
            q.close()

    ra, rb, rc, stats = asyncio.run(main())
    assert ra.token_ids == alone[id(a)] and rc.token_ids == alone[id(c)]
    assert rb.finish_reason == "stopped" and rb.completion_tokens < 500
    assert stats["peak_batch"] >= 2 and stats["batches"] == 1  # one busy period: nobody waited for a batch
    assert stats["running"] == 0 and dense_engine.stats().phase == "idle"


class _Poisoned:
    """The model, failing every forward that computes position `at` (one sequence's alone)."""

    def __init__(self, model, at: int):
        self.model, self.at, self.raised = model, at, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, tokens, positions, kv):
        if tokens.shape[1] == 1 and bool((positions == self.at).any()):
            self.raised += 1
            raise RuntimeError(f"poisoned step at position {self.at}")
        return self.model(tokens, positions, kv)


def test_a_step_failing_inside_a_batch_fails_only_its_sequence_and_is_logged(dense_engine, caplog):
    """A decode step of two sequences raises because of one of them: the step is re-run one
    sequence at a time; that one fails (with the traceback in the log), the other completes with
    exactly its solo tokens."""
    short = GenerationRequest(prompt_ids=[1, 2, 3, 4, 5], max_new_tokens=20, greedy=True, ignore_eos=True)
    long_ids = dense_engine.tokenize("A long prompt that puts this sequence well past the other one in position, "
                                     "so that only it reaches the poisoned position while both decode.")
    doomed = GenerationRequest(prompt_ids=long_ids, max_new_tokens=20, greedy=True, ignore_eos=True)
    solo = dense_engine.generate(short).token_ids
    gen = dense_engine.backend.generator
    poisoned = _Poisoned(gen.model, len(long_ids) + 3)

    async def main():
        q = EngineQueue(dense_engine)
        try:
            js, jd = q.submit(short), q.submit(doomed)
            return (await events_of(js))[-1], (await events_of(jd))[-1]
        finally:
            q.close()

    gen.model = poisoned
    try:
        with caplog.at_level(logging.ERROR, logger="tandem.server"):
            (ks, rs), (kd, err) = asyncio.run(main())
    finally:
        gen.model = poisoned.model
    assert ks == "done" and rs.token_ids == solo
    assert kd == "error" and "poisoned step" in str(err)
    assert poisoned.raised == 2  # the batched step, then the doomed sequence alone
    failed = [r for r in caplog.records if r.name == "tandem.server" and "failed" in r.getMessage()]
    assert failed and failed[0].exc_info is not None
    assert "poisoned step" in logging.Formatter().formatException(failed[0].exc_info)
    assert dense_engine.generate(doomed).completion_tokens == 20  # the engine is fine afterwards


def test_engine_generate_and_the_live_batch_share_one_batch(dense_engine):
    """Engine.generate from another thread while the live batch runs: it waits for a step, not for
    the batch, and both get their solo tokens."""
    a = GenerationRequest(prompt="1, 2, 3, 4,", raw=True, max_new_tokens=30, greedy=True, ignore_eos=True)
    b = GenerationRequest(prompt="Hello there", raw=True, max_new_tokens=10, greedy=True, ignore_eos=True)
    solo_a, solo_b = dense_engine.generate(a).token_ids, dense_engine.generate(b).token_ids
    live = dense_engine.live_batch()
    done = {}
    live.add(a, dense_engine.prompt_ids(a), None, lambda res, err: done.update(a=(res, err)))
    live.step()
    other = threading.Thread(target=lambda: done.update(b=dense_engine.generate(b)))
    other.start()
    while live.busy():
        live.step()
    other.join(60)
    assert done["a"][1] is None and done["a"][0].token_ids == solo_a
    assert done["b"].token_ids == solo_b


def test_a_short_prompt_beside_a_long_one_is_not_held_up_by_its_reading(dense_engine):
    """Two prompts joined in the same step, nobody decoding yet: the long one is read in shares beside
    the short one, which gets its first token at the first step (read whole, the long prompt's
    1,500 tokens would have come first: head-of-line blocking, seen in the tail of `bench serve`)."""
    from engine.runtime.generator import PREFILL_BUDGET
    from engine.runtime.sampling import Sampler, SamplingParams
    from engine.runtime.sequences import SeqRun

    g = dense_engine.backend.generator
    long = SeqRun(list(range(100, 1600)), 4, Sampler(SamplingParams(greedy=True)), set())
    short = SeqRun(list(range(200, 220)), 4, Sampler(SamplingParams(greedy=True)), set())
    for r in (long, short):
        g.admit(r)
    g.step()
    assert short.decoding and short.next_pos == len(short.prompt)
    assert 0 < long.next_pos <= PREFILL_BUDGET and not long.decoding
    while not (long.ended and short.ended):
        g.step()
    dense_engine.backend.parts.kv.free(long.session.seq_id)
    dense_engine.backend.parts.kv.free(short.session.seq_id)
