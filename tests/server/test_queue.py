"""The queue that shares one engine between requests: waiting, refusing when full, cancelling."""

from __future__ import annotations

import asyncio

import pytest

from engine.api import GenerationRequest
from engine.server.queue import EngineQueue, QueueFullError


def test_queue_refuses_when_full_and_cancels_waiting_and_running_jobs(dense_engine):
    async def main():
        q = EngineQueue(dense_engine, max_pending=2)
        try:
            long = q.submit(GenerationRequest(prompt="Once upon a time", raw=True, max_new_tokens=500,
                                              ignore_eos=True))
            kind, _ = await asyncio.wait_for(long.events.get(), 60)  # running now: the others must wait
            assert kind == "text" and q.stats()["running"] == 1
            waiting = q.submit(GenerationRequest(prompt="Hello", raw=True, max_new_tokens=4))
            last = q.submit(GenerationRequest(prompt="1, 2, 3,", raw=True, max_new_tokens=3, greedy=True))
            with pytest.raises(QueueFullError):
                q.submit(GenerationRequest(prompt="one too many", raw=True))
            assert q.stats()["rejected"] == 1 and q.stats()["queued"] == 2
            waiting.cancel()  # never starts
            long.cancel()  # stops at its next step
            events = []
            while not events or events[-1][0] not in ("done", "error"):
                events.append(await asyncio.wait_for(last.events.get(), 60))
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
