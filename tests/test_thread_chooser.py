"""The CPU thread count measured by decode steps (engine/runtime/thread_chooser.py).

The chooser is fed step times from a model of the machine (seconds a step takes at n threads), so
its decisions are checked exactly; the engine test checks that a CPU engine feeds it and says what
it chose. How much it saves on a machine with a busy core is a benchmark's question
(`tandem bench suite --cells cpu-busy-core`), not a test's.
"""

import pytest

from engine.runtime.thread_chooser import MAX_INTERVAL, ThreadChooser


def run(chooser: ThreadChooser, seconds_at, steps: int, batch: int = 1) -> list[int]:
    """Feed `steps` decode steps timed by seconds_at(threads applied); the counts they ran at."""
    ran = []
    for _ in range(steps):
        ran.append(chooser.applied)
        chooser.step(seconds_at(chooser.applied), batch)
    return ran


def chooser_for(cores: int) -> ThreadChooser:
    def apply(n):
        chooser.applied = n

    chooser = ThreadChooser(cores, apply)
    chooser.applied = cores
    return chooser


def busy_core(threads):  # one of two cores taken by another program: two threads wait on it
    return {1: 0.020, 2: 0.200}[threads]


def idle(threads):
    return {1: 0.020, 2: 0.012}[threads]


def test_a_busy_core_is_left_within_a_dozen_steps():
    chooser = chooser_for(2)
    ran = run(chooser, busy_core, 12)
    assert chooser.threads == 1 and chooser.applied == 1 and chooser.changes == 1
    assert ran.count(2) <= 8  # the first count is measured, then one trial of one thread
    assert run(chooser, busy_core, 200).count(2) <= 2 * 4  # trials of two threads end at their first step


def test_an_idle_machine_keeps_every_core_and_trials_grow_rare():
    chooser = chooser_for(2)
    ran = run(chooser, idle, 2000)
    assert chooser.threads == 2 and chooser.changes == 0
    assert ran.count(1) <= 2 * chooser.probes  # a trial of one thread ends after its first measured step
    assert chooser.probes <= 10 and chooser.interval == MAX_INTERVAL


def test_the_count_follows_the_load_both_ways():
    chooser = chooser_for(2)
    run(chooser, idle, 600)
    assert chooser.threads == 2
    run(chooser, busy_core, 30)  # the step time jumps: a trial soon
    assert chooser.threads == 1
    run(chooser, idle, MAX_INTERVAL + 40)  # one thread's time does not move: found at the next trial
    assert chooser.threads == 2


def test_many_cores_walk_down_to_the_free_ones():
    """16 cores, 4 of them busy: 12 threads is the fastest count, and every count above 12 is as slow
    as 16 (no slope down from there): half the count finds the free side, one more climbs back."""
    def seconds_at(n):
        return 0.24 / n if n <= 12 else 0.5

    chooser = chooser_for(16)
    run(chooser, seconds_at, 400)  # 16 → 8 (half), then one more a trial in three: 9, 10, 11, 12
    assert chooser.threads == 12 and chooser.applied == 12


def test_steps_of_another_batch_size_start_the_measurement_over():
    chooser = chooser_for(2)
    run(chooser, idle, 5, batch=1)
    before = chooser.probes
    run(chooser, lambda n: 4 * idle(n), 3, batch=4)  # too few at the new size for a trial
    assert chooser.probes == before and chooser.threads == 2
    run(chooser, idle, 7, batch=1)  # a trial of one thread starts (the interval is WINDOW at first)…
    assert chooser.applied == 1
    run(chooser, idle, 1, batch=2)  # …and a batch of another size ends it: the chosen count again
    assert chooser.applied == chooser.threads == 2


def test_the_count_starts_at_the_cores_that_are_free(monkeypatch):
    import psutil

    from engine.runtime.thread_chooser import free_cores

    for busy, free in (([90.0, 10.0], 1), ([10.0, 20.0], 2), ([95.0, 99.0], 1), ([90.0, 10.0, 5.0], 1)):
        monkeypatch.setattr(psutil, "cpu_percent", lambda interval, percpu, b=busy: b)
        assert free_cores({0, 1}) == free, busy  # (CPU 2 is not ours: not counted)
    chooser = ThreadChooser(4, lambda n: None, start=3)
    assert chooser.threads == 3 and chooser.max_threads == 4


def test_with_every_core_free_at_the_start_trials_wait_unless_the_load_shifts():
    from engine.runtime.thread_chooser import IDLE_START_INTERVAL

    def apply(n):
        chooser.applied = n

    chooser = ThreadChooser(2, apply, start=2, all_free=True)
    chooser.applied = 2
    assert run(chooser, idle, IDLE_START_INTERVAL).count(1) == 0 and chooser.probes == 0  # a reply's length: no trial
    run(chooser, busy_core, 12)  # another program takes a core: the step time shifts, a trial follows at once
    assert chooser.threads == 1 and chooser.changes == 1


def test_one_core_has_nothing_to_choose():
    chooser = chooser_for(1)
    run(chooser, lambda n: 0.01, 100)
    assert chooser.threads == 1 and chooser.probes == 0


@pytest.mark.parametrize("threads,chooses", [(None, True), (1, False)])
def test_a_cpu_engine_measures_its_threads_unless_told(threads, chooses, monkeypatch):
    from engine.api import Engine, EngineConfig, GenerationRequest
    from engine.kernels import native

    monkeypatch.setattr(native, "available_cores", lambda: 2)
    # one core found busy at the start: the chooser begins on one thread and tries two within the reply
    monkeypatch.setattr("engine.runtime.thread_chooser.free_cores", lambda *a, **k: 1)
    engine = Engine(EngineConfig(model="builtin:smollm2-135m", device="cpu", backend="tandem", max_context=512,
                                 max_batch=1, cpu_threads=threads))
    try:
        engine.generate(GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=24, greedy=True, ignore_eos=True))
        info = engine.info()
        if chooses:
            assert info["cpu_threads_max"] == 2 and info["cpu_threads_now"] in (1, 2) and info["cpu_thread_probes"] >= 1
        else:
            assert "cpu_threads_now" not in info
    finally:
        engine.close()


def test_closing_the_engine_puts_the_process_thread_settings_back(monkeypatch):
    """torch's and the native kernels' thread counts are the process's: an engine that chose one puts
    back what it found when it closes."""
    import torch

    from engine.api import Engine, EngineConfig, GenerationRequest
    from engine.kernels import native

    from engine.runtime import thread_chooser

    monkeypatch.setattr(native, "available_cores", lambda: 2)
    monkeypatch.setattr(thread_chooser, "free_cores", lambda: 2)  # (the test machine may be busy)
    before_torch, before_native = torch.get_num_threads(), native.threads_setting()
    torch.set_num_threads(1)
    native.set_threads(None)
    try:
        engine = Engine(EngineConfig(model="builtin:smollm2-135m", device="cpu", backend="tandem", max_context=512,
                                     max_batch=1))
        assert torch.get_num_threads() == 2 and native.threads() == 2  # every core to start with
        engine.generate(GenerationRequest(prompt_ids=[1, 2, 3], max_new_tokens=8, greedy=True, ignore_eos=True))
        engine.close()
        assert torch.get_num_threads() == 1 and native.threads_setting() is None
    finally:
        torch.set_num_threads(before_torch)
        native.set_threads(before_native)
