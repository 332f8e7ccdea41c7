"""The CPU's resident cache under dtype auto holds fp16 rows beside fp32 compute (as llama.cpp's default
cache): half the bytes that a long chat's decode reads every token, half the RAM. An explicit float32
keeps fp32 rows. Built-in SmolLM2 (the README's model), on the CPU.

Tolerance: the rows round to fp16 (relative 2^-11); through 30 layers the logits (std 3.7) moved by
at most 0.0125 (measured), so 0.05, and the greedy tokens stay the same. A prompt's first chunk attends
to its own unrounded k, v, so it is equal.
"""

import pytest
import torch

from engine.api import Engine, EngineConfig
from engine.runtime.planning import placement_plan


def _engine(**kw) -> Engine:
    return Engine(EngineConfig(model="builtin:smollm2-135m", backend="tandem", device="cpu", max_context=1024, **kw))


@torch.inference_mode()
def _logits(engine: Engine, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """(T, V) of every position, fed in steps of `chunks` tokens: prefill chunks, then decode steps."""
    p, kv = engine.parts, engine.parts.kv
    sid, rows, at = kv.new_sequence(), [], 0
    try:
        for n in chunks:
            positions = kv.begin_step([sid], n)
            rows.append(p.model(torch.tensor([ids[at:at + n]]), positions, kv, last_only=False)[0])
            kv.end_step()
            at += n
    finally:
        kv.free(sid)
    return torch.cat(rows).float()


@pytest.fixture(scope="module")
def engines():
    auto, exact = _engine(), _engine(dtype="float32")
    yield auto, exact
    auto.close()
    exact.close()


def test_auto_keeps_fp16_rows_and_float32_keeps_fp32(engines):
    auto, exact = engines
    assert auto.parts.dtype == exact.parts.dtype == torch.float32  # the compute
    assert auto.parts.kv.k.dtype == auto.parts.kv.v.dtype == torch.float16
    assert exact.parts.kv.k.dtype == torch.float32


def test_fp16_rows_give_the_fp32_answer(engines):
    """A second prefill chunk reads the first's rows (fp16 into fp32 attention), then native decode
    steps read and write them in place."""
    auto, exact = engines
    ids = [(37 * i + 11) % 4000 + 100 for i in range(520)]
    chunks = [300, 200] + [1] * 20
    ours, theirs = _logits(auto, ids, chunks), _logits(exact, ids, chunks)
    assert torch.equal(ours[:300], theirs[:300])
    torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_the_plan_counts_two_bytes_a_row():
    """The RAM the plan adds for 4,096 more tokens of context: half under auto of what float32 adds."""
    def ram(dtype: str, context: int) -> int:
        return placement_plan(EngineConfig(model="builtin:smollm2-135m", backend="tandem", device="cpu", dtype=dtype,
                                           max_context=context, max_batch=1)).ram_bytes

    per_token = 30 * 3 * 64 * 2  # SmolLM2-135M: layers · KV heads · head dim · (K and V)
    assert ram("auto", 8192) - ram("auto", 4096) == 4096 * per_token * 2
    assert ram("float32", 8192) - ram("float32", 4096) == 4096 * per_token * 4
