"""The engine counts how far it has read the prompt in prefill (StatsSnapshot.speed.prefill_done of
prefill_total), so the app can say "reading 1,024 / 1,600 tokens" from the engine's own numbers."""

import threading

from engine.api import Engine, EngineConfig, GenerationRequest


def test_prefill_progress_is_counted_by_the_engine():
    engine = Engine(EngineConfig(model="builtin:smollm2-135m", device="cpu", max_context=2048, max_batch=1))
    try:
        prompt = list(range(100, 1700))  # four prefill chunks of 512 or fewer
        seen, done = [], threading.Event()

        def sample():
            while not done.is_set():
                speed = engine.stats().to_dict()["speed"]
                if speed["prefill_total"] is not None:
                    seen.append((speed["prefill_done"], speed["prefill_total"]))
                done.wait(0.02)

        watcher = threading.Thread(target=sample)
        watcher.start()
        try:
            engine.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=2, greedy=True))
        finally:
            done.set()
            watcher.join()
        assert seen and all(total == len(prompt) for _, total in seen)
        reads = [d for d, _ in seen]
        assert reads == sorted(reads) and 0 <= reads[0] < len(prompt) and len(set(reads)) >= 2
        after = engine.stats().to_dict()["speed"]
        assert (after["prefill_done"], after["prefill_total"]) == (None, None)  # none is being read now
    finally:
        engine.close()
