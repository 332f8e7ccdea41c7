"""The KV/attention interface between the models and the KV placement.

One forward pass of the model is one *step* over a batch of sequences that each add the same
number of new tokens T (prefill: one sequence, T prompt tokens; decode: B sequences, T = 1):

    positions = kv.begin_step(seq_ids, T)       # (B, T) absolute positions, for RoPE
    for each layer:  y = kv.attend(layer, q, k, v)   # stores k, v; attends over all of the past
    kv.end_step()                               # the new tokens now count as cached

A backend owns both where the KV lives and how attention reads it, because a hybrid backend
(WriteScope) splits that attention between engines. Sequences are cropped (regenerate, edit) and
freed through the same object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class KVBackend(ABC):
    policy: str = "?"

    @property
    def flash_prefill(self) -> bool:
        """Whether one sequence's prefill chunk attends here without materialising (nh, T, S) scores —
        causal, with attention sinks or within a sliding window — so that its size is not bounded by them."""
        return False

    @abstractmethod
    def new_sequence(self) -> int:
        """Reserve a sequence slot; returns its id."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Release every block of the sequence for reuse."""

    @abstractmethod
    def crop(self, seq_id: int, n_tokens: int) -> None:
        """Keep the first n_tokens of the sequence's KV; the tail blocks are freed."""

    @abstractmethod
    def length(self, seq_id: int) -> int:
        """Tokens of the sequence whose KV is cached."""

    def resume_point(self, seq_id: int, n_tokens: int) -> int:
        """The longest prefix ≤ n_tokens that `crop` can keep: KV blocks can be cut anywhere; a
        recurrent state (kv/recurrent.py) only where it was kept."""
        return n_tokens

    @abstractmethod
    def begin_step(self, seq_ids: list[int], n_new: int) -> torch.Tensor:
        """Make room for n_new tokens in each sequence; returns positions (B, T) on the device."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (B, nh, T, hs); k, v: (B, n_kv, T, hs) of the new tokens → (B, nh, T, hs)."""

    def decode_store(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where the begun step's new K and V rows of `layer` go, for a projection kernel that writes
        them there itself: (k_cache, v_cache (slots, n_kv, hs) contiguous, rows (B·T,) int64 on the
        device), after which `attend` takes k = v = None. None: attend stores k and v (the default)."""
        return None

    @abstractmethod
    def end_step(self) -> None:
        """Commit the step's tokens."""

    @abstractmethod
    def telemetry(self) -> dict:
        """Bytes and token counts per region, for StatsSnapshot (None where a region is absent)."""
