"""Qwen3.5-MoE's decode step as a CUDA graph: the recurrent states in fixed buffers per batch size
(engine/kv/recurrent.py `fix_states`: max_batch rows, a batch of B in the first B), read and written in place, copied out for each chat after the
step.

On the CPU the protocol a replay follows is walked eagerly (stage, a warm-up that moves the buffers
on, stage again, the step, end) and must give the logits of plain eager steps exactly, across crops
to a snapshot and a failed step; on CUDA the graphs' tokens must be those of eager decode, for one
chat, a batch of two and offloaded experts (pieces).
"""

import pytest
import torch

from engine.api import GenerationRequest

from moe_helpers import tiny_engine
from test_qwen3_5_moe_cuda import _folder

PROMPT = [(13 * i + 7) % 128 for i in range(40)]


def _step(engine, sids, tokens, replay: bool):
    """One decode step; `replay`: the way decode_graph.py runs it, eagerly (the warm-up, then the
    step proper, both in the fixed buffers)."""
    p, kv = engine.parts, engine.parts.kv
    positions = kv.begin_step(sids, 1)
    x = torch.tensor([[t] for t in tokens])
    if replay:
        kv.fix_states(len(sids))
        p.model(x, positions, kv)  # the warm-up: writes the buffers in place (they must be staged again)
        kv.fix_states(len(sids))
    logits = p.model(x, positions, kv)
    if replay:
        kv.replayed_step()
    kv.end_step()
    return logits


def _prefill(engine, sid, ids):
    p, kv = engine.parts, engine.parts.kv
    positions = kv.begin_step([sid], len(ids))
    p.model(torch.tensor([ids]), positions, kv)
    kv.end_step()


@torch.inference_mode()
def test_fixed_buffers_give_the_eager_steps(tmp_path, monkeypatch):
    """Two chats of different lengths decoded together (batch 2), then one alone (batch 1, its own
    buffers), a step cropped away (the state back to the snapshot: the rows must be staged again),
    each against eager steps of a second engine on the same weights; a batch larger than the buffers'
    rows is refused."""
    folder = _folder(tmp_path, monkeypatch)
    ours, ref = tiny_engine(folder), tiny_engine(folder)
    a, b = ([e.parts.kv.new_sequence() for _ in range(2)] for e in (ours, ref))
    for engine, sids in ((ours, a), (ref, b)):
        _prefill(engine, sids[0], PROMPT)
        _prefill(engine, sids[1], PROMPT[:9])
    tokens = [[5, 6], [7, 8], [9, 10]]
    for pair in tokens:
        torch.testing.assert_close(_step(ours, a, pair, True), _step(ref, b, pair, False), atol=1e-6, rtol=0)
    for t in [11, 12]:
        torch.testing.assert_close(_step(ours, a[:1], [t], True), _step(ref, b[:1], [t], False), atol=1e-6, rtol=0)
    for engine, sids in ((ours, a), (ref, b)):  # the last step is undone, and another token fed instead
        engine.parts.kv.crop(sids[0], engine.parts.kv.length(sids[0]) - 1)
    torch.testing.assert_close(_step(ours, a[:1], [13], True), _step(ref, b[:1], [13], False), atol=1e-6, rtol=0)
    torch.testing.assert_close(_step(ours, a, [14, 15], True), _step(ref, b, [14, 15], False), atol=1e-6, rtol=0)
    kv = ours.parts.kv
    kv.begin_step(a + [kv.new_sequence()], 1)
    with pytest.raises(ValueError, match="3 rows"):
        kv.fix_states(3)
    kv.end_step()
    assert ours.parts.kv.fixed_bytes() == 2 * ours.parts.kv.n_layers * 4 * (128 * 3 + 4 * 16 * 16)  # max_batch rows


@torch.inference_mode()
def test_a_failed_step_leaves_the_snapshot(tmp_path, monkeypatch):
    """A step that raises inside the fixed buffers keeps no state; cropped back, the chat continues
    as if the step never ran."""
    folder = _folder(tmp_path, monkeypatch)
    ours, ref = tiny_engine(folder), tiny_engine(folder)
    sid, rid = ours.parts.kv.new_sequence(), ref.parts.kv.new_sequence()
    _prefill(ours, sid, PROMPT)
    _prefill(ref, rid, PROMPT)
    kv = ours.parts.kv
    kv.begin_step([sid], 1)
    kv.fix_states(1)
    kv.end_step()  # no replayed_step: the step raised
    assert kv.states[sid].state is None
    kv.crop(sid, len(PROMPT))
    torch.testing.assert_close(_step(ours, [sid], [3], True), _step(ref, [rid], [3], False), atol=1e-6, rtol=0)


def test_graphs_are_allowed_for_the_hybrid_model(tmp_path, monkeypatch):
    """The recurrent KV no longer keeps a model's decode from being captured: the reason given on
    the CPU is the device's, and the fixed buffers are sized from the model's shape."""
    engine = tiny_engine(_folder(tmp_path, monkeypatch))
    assert engine.info()["cuda_graphs"] == {"off": "graphs need CUDA"}
    kv = engine.parts.kv
    assert kv.row_shapes == ((2 * 2 * 16 + 4 * 16, 3), (4, 16, 16))  # conv (q, k, v channels, kernel − 1), S


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tokens(engine):
    one = engine.generate(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=10, greedy=True, ignore_eos=True))
    two = engine.generate_batch([GenerationRequest(prompt_ids=p, max_new_tokens=10, greedy=True, ignore_eos=True)
                                 for p in (PROMPT, PROMPT[:7])])
    return [one.token_ids] + [r.token_ids for r in two]


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("experts", [dict(expert_policy="resident", dtype="bfloat16"),
                                     dict(expert_policy="on-demand", expert_cache_slots=6, dtype="float32")])
def test_graph_decode_equals_eager_decode(tmp_path, monkeypatch, experts):
    """Offloaded experts in fp32: the graph's steps read misses in place with their own kernels, and
    which experts overflow a 6-slot cache to the CPU in a prefill follows the cache's history, so bf16
    would round the two engines' experts differently (as tests/models/test_decode_graph.py)."""
    folder = _folder(tmp_path, monkeypatch)
    eager = tiny_engine(folder, device="cuda", max_context=1024, cuda_graphs=False, **experts)
    expected = _tokens(eager)
    eager.close()
    graphed = tiny_engine(folder, device="cuda", max_context=1024, **experts)
    got = _tokens(graphed)
    tel = graphed.info()["cuda_graphs"]
    assert tel.get("failed") is None and tel["captured_batches"] == [1, 2] and tel["replays"] >= 2 * 8, tel
    assert got == expected
    graphed.close()
