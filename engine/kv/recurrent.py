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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kv.backend import KVBackend

SNAPSHOTS = 2  # states kept per sequence besides the current one: the steps a crop may undo (the decode
# runs one step ahead, and a failed step is cropped away); each costs a full state (Qwen3.5-35B-A3B: 66 MB)
STATES_PER_SEQUENCE = SNAPSHOTS + 2  # at most: the current one, the snapshots, the one keep_state holds


@dataclass
class _SeqState:
    length: int = 0
    layers: list | None = None  # per recurrent layer (conv, state), batch dim 1; None: fresh (zeros)
    snapshots: dict[int, list | None] = field(default_factory=dict)  # length → layers, oldest first
    kept: tuple[int, list | None] | None = None  # (length, layers) held past the snapshots (keep_state)


class RecurrentKV(KVBackend):
    recurrent = True

    def __init__(self, inner: KVBackend, n_recurrent_layers: int):
        self.inner = inner
        self.n_layers = n_recurrent_layers
        self.states: dict[int, _SeqState] = {}
        self._step: list[int] | None = None  # the sequences of the step under way, in row order
        self._new: list | None = None  # per recurrent layer: the step's (conv, state), batched

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
        st.kept = (st.length, st.layers)

    def crop(self, seq_id: int, n_tokens: int) -> None:
        st = self.states[seq_id]
        if n_tokens >= st.length:
            self.inner.crop(seq_id, n_tokens)
            return
        if n_tokens == 0:
            st.layers = None
        elif n_tokens in st.snapshots:
            st.layers = st.snapshots[n_tokens]
        elif st.kept and st.kept[0] == n_tokens:
            st.layers = st.kept[1]
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
            st.snapshots[st.length] = st.layers
            while len(st.snapshots) > SNAPSHOTS:
                st.snapshots.pop(next(iter(st.snapshots)))
        self._step, self._new = list(seq_ids), [None] * self.n_layers
        return positions

    def recurrent_state(self, index: int):
        """(conv (B, C, K−1), state (B, …)) of the step's sequences for recurrent layer `index`, or
        (None, None) when all of them start fresh (the layer then starts from zeros)."""
        per_seq = [self.states[sid].layers for sid in self._step]
        if all(layers is None for layers in per_seq):
            return None, None
        if len(per_seq) == 1:
            return per_seq[0][index]
        conv, state = [], []
        for layers, sid in zip(per_seq, self._step):
            if layers is None:  # a fresh sequence beside continuing ones: explicit zeros
                ref_conv, ref_state = next(p for p in per_seq if p is not None)[index]
                conv.append(torch.zeros_like(ref_conv))
                state.append(torch.zeros_like(ref_state))
            else:
                conv.append(layers[index][0])
                state.append(layers[index][1])
        return torch.cat(conv), torch.cat(state)

    def set_recurrent_state(self, index: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        self._new[index] = (conv, state)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
        return self.inner.attend(layer, q, k, v, **options)

    def end_step(self) -> None:
        self.inner.end_step()
        complete = all(s is not None for s in self._new)
        for row, sid in enumerate(self._step):
            st = self.states[sid]
            if not complete:  # the step raised: no usable state; the caller crops back to the snapshot
                st.layers = None
            elif len(self._step) == 1:
                st.layers = self._new
            else:  # copies: a row's view would keep the whole batch's tensor alive in the snapshots
                st.layers = [(c[row:row + 1].clone(), s[row:row + 1].clone()) for c, s in self._new]
            st.length = self.inner.length(sid)
        self._step = self._new = None

    def telemetry(self) -> dict:
        return self.inner.telemetry()

    def state_bytes(self) -> int:
        """Device bytes the kept states and snapshots hold (a tensor counted once)."""
        seen, total = set(), 0
        for st in self.states.values():
            for layers in [st.layers, *st.snapshots.values()]:
                for pair in layers or ():
                    for t in pair:
                        key = t.untyped_storage().data_ptr()
                        if key not in seen:
                            seen.add(key)
                            total += t.untyped_storage().nbytes()
        return total
