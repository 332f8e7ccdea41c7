"""Recurrent state beside the KV of hybrid models (Qwen3.5: Gated DeltaNet layers between the
full-attention ones): `RecurrentKV` wraps the KV backend of the attention layers and keeps, per
sequence, each recurrent layer's state (what the model hands it: tensors on the compute device).

A state summarises all of a sequence's tokens; it cannot be cut back to an earlier length the way
KV blocks can. So the state *before* each step is kept as a snapshot (a reference, no copy: the
layers return new tensors every step; a step of several sequences copies each one's rows out), the
last SNAPSHOTS of them per sequence. `crop` to one of those lengths (a decode step fed a token that
ended the sequence, a failed step, a new turn that continues where the last one stopped) restores
it. The generator also keeps one state per sequence for longer (`keep_state`): the one before a
prompt's last token, where a regenerate of the reply resumes. `resume_point` tells the generator how
far back a crop can go, so a turn that changes earlier tokens (an edit) reads the prompt again from
the start, or from the newest kept state before the change.

Every other call goes to the wrapped backend: this object is the model's `kv`, the same in
resident and hybrid placements; only the attention layers' KV is placed.

A decode step replayed as a CUDA graph (engine/runtime/decode_graph.py) reads and writes memory at
the addresses it was captured with, so for such a step the states sit in fixed buffers of max_rows
rows (a batch of B uses the first B, whatever B): `fix_states(B)` copies the step's states into them
(unless a row holds its sequence's already), the layers read them there and write the new states
back in place, and `end_step` copies each row out for the sequence (its snapshots must survive the
next step's writes). Per step that is one copy of the batch's states (Qwen3.5-35B-A3B: 66 MB a chat,
~30 µs on an H200) against the ~1 ms a layer's eager launches cost.

Those copies are one per sequence, not one per layer and tensor (Qwen3.5-35B-A3B: 60), because a
row is one contiguous run of S floats, S all of one sequence's states: the fixed buffers are one
(R, S) fp32 tensor whose per-layer (conv, state) are views of it, and a row is copied out to one
(1, S) tensor. A sequence's state is therefore one of two forms:
  - flat, one (1, S) tensor: what a captured step leaves (captured steps run on CUDA, whose caching
    allocator hands the freed tensors' blocks back); a layer of an eager step reads views of it
    (`_layer`), and staging it into a row is one copy;
  - per layer, a list of (conv (1, C, K−1), state (1, …)): what an eager step leaves. One sequence's
    are the model's own tensors, kept by reference as the snapshots are (flattening them would add
    a full copy of the state to every prefill and eager decode step); a batched step copies each
    row out per layer, since on the CPU a (1, S) tensor per row (66 MB) is above the C allocator's
    mmap threshold and comes as fresh pages every step, where the per-layer copies reuse freed
    memory. Staging this form into a row is one concatenation; the row's copy out is flat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.kv.backend import KVBackend

SNAPSHOTS = 2  # states kept per sequence besides the current one: the steps a crop may undo (the decode
# runs one step ahead, and a failed step is cropped away); each costs a full state (Qwen3.5-35B-A3B: 66 MB)
STATES_PER_SEQUENCE = SNAPSHOTS + 3  # at most: the current one, the snapshots, the one keep_state holds,
# and its row of the fixed buffers of captured steps


@dataclass
class _Fixed:
    """Captured steps' states at fixed addresses: `flat` (R, S) fp32, `layers` its views per
    recurrent layer (conv (R, C, K−1), state (R, …)); `holds` the (seq_id, state) each row holds a
    copy of, None where it must be staged; `batch` the rows of the step under way."""

    flat: torch.Tensor
    layers: list
    holds: list
    batch: int = 0


# A sequence's state (module docstring): a (1, S) tensor, a list per recurrent layer of
# (conv (1, C, K−1), state (1, …)), or None: fresh (the layers start from zeros).
State = torch.Tensor | list | None


@dataclass
class _SeqState:
    length: int = 0
    state: State = None
    snapshots: dict[int, State] = field(default_factory=dict)  # length → state, oldest first
    kept: tuple[int, State] | None = None  # (length, state) held past the snapshots (keep_state)


class RecurrentKV(KVBackend):
    recurrent = True

    def __init__(self, inner: KVBackend, n_recurrent_layers: int, row_shapes: tuple, device: torch.device,
                 max_rows: int = 1):
        """row_shapes: one sequence's (conv (C, K−1), state (…)) of a layer, the same for every
        recurrent layer; they lay out the flat states (S floats a sequence, per layer conv then
        state) and size the fixed buffers of captured steps, on `device`; max_rows: the largest
        batch a step runs (the buffers' rows, made at the first captured step)."""
        self.inner = inner
        self.n_layers = n_recurrent_layers
        self.row_shapes, self.device, self.max_rows = row_shapes, device, max_rows
        self._conv_floats = math.prod(row_shapes[0])
        self._layer_floats = self._conv_floats + math.prod(row_shapes[1])
        self.row_floats = self._layer_floats * n_recurrent_layers  # S
        self.states: dict[int, _SeqState] = {}
        self._step: list[int] | None = None  # the sequences of the step under way, in row order
        self._new: list | None = None  # per recurrent layer: the step's (conv, state), batched
        self._fixed: _Fixed | None = None  # the buffers captured steps read and write (fix_states)
        self._fixed_step: _Fixed | None = None  # set by fix_states: this step's states live there
        self._replayed = False  # the captured step ran to its end (replayed_step)

    def __getattr__(self, name):  # policy, telemetry fields, supports_* … are the attention KV's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # -- sequences ----------------------------------------------------------------------------------
    def new_sequence(self) -> int:
        sid = self.inner.new_sequence()
        self.states[sid] = _SeqState()
        return sid

    def free(self, seq_id: int) -> None:
        self.inner.free(seq_id)
        self.states.pop(seq_id, None)
        if self._fixed is not None:  # (the rows' references would keep its states alive)
            self._fixed.holds = [None if h is not None and h[0] == seq_id else h for h in self._fixed.holds]

    def length(self, seq_id: int) -> int:
        return self.inner.length(seq_id)

    def resume_point(self, seq_id: int, n_tokens: int) -> int:
        """The longest prefix ≤ n_tokens whose state is kept: the current one, a snapshot, the one
        keep_state holds, or 0."""
        st = self.states[seq_id]
        kept = [0] + list(st.snapshots) + [st.length] + ([st.kept[0]] if st.kept else [])
        return max(m for m in kept if m <= n_tokens)

    def keep_state(self, seq_id: int) -> None:
        """Hold the sequence's current state until a crop goes below it or the next keep_state: the
        generator keeps the state one token before a prompt's end, where a regenerate resumes."""
        st = self.states[seq_id]
        st.kept = (st.length, st.state)

    def crop(self, seq_id: int, n_tokens: int) -> None:
        st = self.states[seq_id]
        if n_tokens >= st.length:
            self.inner.crop(seq_id, n_tokens)
            return
        if n_tokens == 0:
            st.state = None
        elif n_tokens in st.snapshots:
            st.state = st.snapshots[n_tokens]
        elif st.kept and st.kept[0] == n_tokens:
            st.state = st.kept[1]
        else:
            raise ValueError(f"sequence {seq_id}: no recurrent state at {n_tokens} tokens "
                             f"(kept: {sorted(st.snapshots)}, {st.length}); ask resume_point first")
        st.snapshots = {m: s for m, s in st.snapshots.items() if m < n_tokens}
        if st.kept and st.kept[0] > n_tokens:
            st.kept = None
        st.length = n_tokens
        self.inner.crop(seq_id, n_tokens)

    # -- steps --------------------------------------------------------------------------------------
    def begin_step(self, seq_ids: list[int], n_new: int) -> torch.Tensor:
        positions = self.inner.begin_step(seq_ids, n_new)
        for sid in seq_ids:
            st = self.states[sid]
            st.snapshots[st.length] = st.state
            while len(st.snapshots) > SNAPSHOTS:
                st.snapshots.pop(next(iter(st.snapshots)))
        self._step, self._new = list(seq_ids), [None] * self.n_layers
        return positions

    def _layer(self, state: State, index: int) -> tuple:
        """Recurrent layer `index`'s (conv (R, C, K−1), state (R, …)) of a state in either form:
        views of a flat (R, S) one, or the per-layer list's entry."""
        if not isinstance(state, torch.Tensor):
            return state[index]
        rows, start = state.shape[0], index * self._layer_floats
        mid, end = start + self._conv_floats, start + self._layer_floats
        conv_shape, state_shape = self.row_shapes
        return state[:, start:mid].view(rows, *conv_shape), state[:, mid:end].view(rows, *state_shape)

    def recurrent_state(self, index: int):
        """(conv (B, C, K−1), state (B, …)) of the step's sequences for recurrent layer `index`, or
        (None, None) when all of them start fresh (the layer then starts from zeros)."""
        fixed = self._fixed_step
        if fixed is not None:
            conv, state = fixed.layers[index]
            return conv[:fixed.batch], state[:fixed.batch]  # views: the same addresses at every step
        per_seq = [self.states[sid].state for sid in self._step]
        if all(s is None for s in per_seq):
            return None, None
        if len(per_seq) == 1:
            return self._layer(per_seq[0], index)
        conv, state = [], []
        for s in per_seq:
            if s is None:  # a fresh sequence beside continuing ones: explicit zeros
                ref_conv, ref_state = self._layer(next(p for p in per_seq if p is not None), index)
                conv.append(torch.zeros_like(ref_conv))
                state.append(torch.zeros_like(ref_state))
            else:
                c, v = self._layer(s, index)
                conv.append(c)
                state.append(v)
        return torch.cat(conv), torch.cat(state)

    def set_recurrent_state(self, index: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        fixed = self._fixed_step
        if fixed is None:
            self._new[index] = (conv, state)
            return
        fixed.layers[index][0][:fixed.batch].copy_(conv)  # in place: a graph replays these copies
        fixed.layers[index][1][:fixed.batch].copy_(state)
        if not (conv.is_cuda and torch.cuda.is_current_stream_capturing()):
            fixed.holds = [None] * len(fixed.holds)  # an eager run (a graph's warm-up) moved them on

    # -- fixed buffers for captured steps -------------------------------------------------------------
    def fix_states(self, batch: int) -> None:
        """This step's states are read and written in the first `batch` rows of the fixed buffers (made
        at the first call): copies each sequence's state into its row unless the row holds it already."""
        per_seq = [self.states[sid].state for sid in self._step]
        if batch != len(per_seq) or batch > self.max_rows:
            raise ValueError(f"a captured step of {batch} rows: the step has {len(per_seq)} sequences, "
                             f"the buffers {self.max_rows} rows")
        fixed = self._fixed
        if fixed is None:
            flat = torch.zeros(self.max_rows, self.row_floats, dtype=torch.float32, device=self.device)  # (R, S)
            fixed = self._fixed = _Fixed(flat, [self._layer(flat, i) for i in range(self.n_layers)],
                                         [None] * self.max_rows)
        fixed.batch = batch
        for row, (sid, state) in enumerate(zip(self._step, per_seq)):
            held = fixed.holds[row]
            if held is not None and held[0] == sid and held[1] is state:
                continue
            dest = fixed.flat[row:row + 1]  # (1, S), contiguous
            if state is None:  # fresh: the layers start from zeros
                dest.zero_()
            elif isinstance(state, torch.Tensor):
                dest.copy_(state)
            else:  # one concatenation (a conv state that is a view of the layer's window is copied first)
                torch.cat([t.reshape(1, -1) for pair in state for t in pair], dim=1, out=dest)
            fixed.holds[row] = (sid, state)
        self._fixed_step = fixed

    def unfix_states(self) -> None:
        """The step runs eagerly after all (a capture failed): the sequences' own states again."""
        self._fixed_step = None

    def replayed_step(self) -> None:
        """The captured step ran to its end: the fixed buffers hold the new states (end_step keeps them)."""
        self._replayed = True

    def fixed_bytes(self) -> int:
        fixed = self._fixed
        return 0 if fixed is None else fixed.flat.numel() * fixed.flat.element_size()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
        return self.inner.attend(layer, q, k, v, **options)

    def end_step(self) -> None:
        self.inner.end_step()
        fixed, replayed, self._fixed_step, self._replayed = self._fixed_step, self._replayed, None, False
        if fixed is not None:
            self._end_fixed_step(fixed, replayed)
            return
        complete = all(s is not None for s in self._new)
        for row, sid in enumerate(self._step):
            st = self.states[sid]
            if not complete:  # the step raised: no usable state; the caller crops back to the snapshot
                st.state = None
            elif len(self._step) == 1:
                st.state = self._new
            else:  # copies: a row's view would keep the whole batch's tensor alive in the snapshots
                st.state = [(c[row:row + 1].clone(), s[row:row + 1].clone()) for c, s in self._new]
            st.length = self.inner.length(sid)
        self._step = self._new = None

    def _end_fixed_step(self, fixed: _Fixed, replayed: bool) -> None:
        for row, sid in enumerate(self._step):
            st = self.states[sid]
            if replayed:  # one copy per sequence: the next step overwrites the rows in place
                st.state = fixed.flat[row:row + 1].clone()  # (1, S)
                fixed.holds[row] = (sid, st.state)
            else:  # the step raised part-way: no usable state; the caller crops back to the snapshot
                st.state = None
                fixed.holds[row] = None
            st.length = self.inner.length(sid)
        self._step = self._new = None

    def telemetry(self) -> dict:
        return self.inner.telemetry()

    def state_bytes(self) -> int:
        """Device bytes the sequences' states (current, snapshots, the one keep_state holds) and the
        fixed buffers hold, each storage counted once and whole (a conv state that is a view of the
        layer's window counts the window)."""
        seen, total = set(), self.fixed_bytes()
        for st in self.states.values():
            for state in [st.state, *st.snapshots.values(), st.kept[1] if st.kept else None]:
                tensors = [state] if isinstance(state, torch.Tensor) else [t for pair in state or () for t in pair]
                for t in tensors:
                    key = t.untyped_storage().data_ptr()
                    if key not in seen:
                        seen.add(key)
                        total += t.untyped_storage().nbytes()
        return total
