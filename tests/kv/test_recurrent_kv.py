"""RecurrentKV's flat states (engine/kv/recurrent.py): a captured step's rows live in one (R, S)
buffer and are copied out one copy per sequence, into states that alias neither the buffer nor each
other; staging copies one row per sequence (or none where the row holds it); eager steps keep their
semantics (one sequence: the model's tensors by reference; several: per-layer copies of each row),
and state_bytes counts each storage once. A stand-in model writes new states from the old ones, and the
values are checked against the same arithmetic done by hand."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.kv.recurrent import RecurrentKV

ROWS = ((6, 3), (2, 4, 5))  # conv (C, K−1), state (nv, dk, dv) of one sequence and layer
LAYERS = 3
S = LAYERS * (6 * 3 + 2 * 4 * 5)  # floats of one sequence's states


class _Inner:
    """The attention KV's bookkeeping only: lengths."""

    def __init__(self):
        self.lengths, self.step = {}, None

    def new_sequence(self):
        sid = len(self.lengths)
        self.lengths[sid] = 0
        return sid

    def begin_step(self, sids, n):
        self.step = (sids, n)
        return torch.zeros(len(sids), n, dtype=torch.long)

    def end_step(self):
        for sid in self.step[0]:
            self.lengths[sid] += self.step[1]

    def length(self, sid):
        return self.lengths[sid]

    def crop(self, sid, n):
        self.lengths[sid] = n

    def free(self, sid):
        self.lengths.pop(sid)


class _Copies(TorchDispatchMode):
    """Counts the ops that move data (views, slices and the like are free)."""

    MOVES = ("copy_", "clone", "cat", "zero_", "fill_", "zeros", "empty")

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += any(m in str(func.overloadpacket) for m in self.MOVES)
        return func(*args, **(kwargs or {}))


def _model(kv, B, bump):
    """What the layers do: read each layer's states, hand back conv + bump and 2 × state + bump."""
    for i in range(LAYERS):
        conv, state = kv.recurrent_state(i)
        conv = torch.zeros(B, *ROWS[0]) if conv is None else conv
        state = torch.zeros(B, *ROWS[1]) if state is None else state
        kv.set_recurrent_state(i, conv + bump, 2 * state + bump)


def _expected(bumps):
    """Per layer (conv, state) of one sequence after steps adding `bumps` from fresh."""
    conv, state = torch.zeros(1, *ROWS[0]), torch.zeros(1, *ROWS[1])
    for b in bumps:
        conv, state = conv + b, 2 * state + b
    return [(conv, state)] * LAYERS


def _step(kv, sids, bump, replay):
    kv.begin_step(sids, 1)
    if replay:  # as decode_graph.py: stage, the warm-up (moves the rows on), stage again, the step
        kv.fix_states(len(sids))
        _model(kv, len(sids), 100.0)
        kv.fix_states(len(sids))
    _model(kv, len(sids), bump)
    if replay:
        kv.replayed_step()
    kv.end_step()


def _assert_state(kv, sid, bumps):
    state = kv.states[sid].state
    for i, (conv, s) in enumerate(_expected(bumps)):
        got_conv, got_state = kv._layer(state, i)
        torch.testing.assert_close(got_conv, conv, atol=0, rtol=0)
        torch.testing.assert_close(got_state, s, atol=0, rtol=0)


@pytest.fixture
def kv():
    return RecurrentKV(_Inner(), LAYERS, ROWS, torch.device("cpu"), max_rows=4)


def test_a_replayed_step_copies_each_row_out_once(kv):
    a, b = kv.new_sequence(), kv.new_sequence()
    _step(kv, [a], 1.0, replay=False)  # a prefill: per-layer tensors, staged by one concatenation
    _step(kv, [a, b], 2.0, replay=True)
    _assert_state(kv, a, [1.0, 2.0])
    _assert_state(kv, b, [2.0])
    kv.begin_step([a, b], 1)
    kv.fix_states(2)  # the rows hold both: nothing is staged
    _model(kv, 2, 3.0)
    kv.replayed_step()
    with _Copies() as copies:
        kv.end_step()
    assert copies.n == 2  # one clone per sequence, not one per layer and tensor
    fixed = kv._fixed
    assert fixed.flat.shape == (4, S) and fixed.layers[1][1].shape == (4, *ROWS[1])
    assert fixed.layers[2][1].untyped_storage().data_ptr() == fixed.flat.untyped_storage().data_ptr()
    for sid in (a, b):
        state = kv.states[sid].state
        assert isinstance(state, torch.Tensor) and state.shape == (1, S)
        assert all(t.untyped_storage().data_ptr() == state.untyped_storage().data_ptr()
                   for i in range(LAYERS) for t in kv._layer(state, i))
    assert kv.states[a].state.untyped_storage().data_ptr() != kv.states[b].state.untyped_storage().data_ptr()
    kept = kv.states[a].state.clone()
    fixed.flat.fill_(-1.0)  # the next step's writes in place
    assert torch.equal(kv.states[a].state, kept)
    _assert_state(kv, a, [1.0, 2.0, 3.0])
    _assert_state(kv, b, [2.0, 3.0])


def test_staging_is_one_copy_a_row_and_none_where_held(kv):
    a, b = kv.new_sequence(), kv.new_sequence()
    _step(kv, [a, b], 1.0, replay=True)
    for held in (True, False):
        kv.begin_step([a, b], 1)
        if not held:
            kv._fixed.holds = [None] * 4
        with _Copies() as copies:
            kv.fix_states(2)
        assert copies.n == (0 if held else 2)
        kv.unfix_states()
        kv.end_step()
        kv.crop(a, 1)
        kv.crop(b, 1)
    _step(kv, [b, a], 5.0, replay=True)  # rows swapped: both staged again
    _assert_state(kv, a, [1.0, 5.0])
    _assert_state(kv, b, [1.0, 5.0])


def test_eager_steps_and_crops_keep_their_semantics(kv):
    a, b = kv.new_sequence(), kv.new_sequence()
    _step(kv, [a], 1.0, replay=False)
    assert isinstance(kv.states[a].state, list)  # one sequence: the model's own tensors, by reference
    snapshot = kv.states[a].state
    _step(kv, [a, b], 2.0, replay=False)  # several: each row copied out, per layer
    assert kv.states[a].snapshots[1] is snapshot
    assert all(isinstance(kv.states[s].state, list) for s in (a, b))
    _assert_state(kv, a, [1.0, 2.0])
    _assert_state(kv, b, [2.0])
    _step(kv, [a, b], 3.0, replay=True)  # staged by concatenation; flat after
    kv.crop(a, 2)
    _assert_state(kv, a, [1.0, 2.0])
    _step(kv, [a], 4.0, replay=True)  # the crop's state differs from what row 0 holds: staged again
    _assert_state(kv, a, [1.0, 2.0, 4.0])
    kv.begin_step([a], 1)
    kv.fix_states(1)
    kv.end_step()  # no replayed_step: the step raised
    assert kv.states[a].state is None
    kv.crop(a, 3)
    _assert_state(kv, a, [1.0, 2.0, 4.0])


def test_state_bytes_counts_each_storage_once(kv):
    a, b = kv.new_sequence(), kv.new_sequence()
    _step(kv, [a, b], 1.0, replay=True)
    _step(kv, [a, b], 2.0, replay=True)
    row = 4 * S
    # the fixed buffers (4 rows), then per sequence: the current state and the one before the last
    # step (its snapshot; the snapshot of the fresh state is None)
    assert kv.fixed_bytes() == 4 * row
    assert kv.state_bytes() == 4 * row + 2 * 2 * row
    kv.keep_state(a)  # the current state once more: no new storage
    assert kv.state_bytes() == 4 * row + 2 * 2 * row
