"""The monolithic comparison policy: one pinned buffer re-prepared every step (seed 000, §3, App. A).

This is the DynamicCache-style offloaded cache the paper measures against, kept in the same runtime
with the same kernels so that only the KV management differs:

    host      (n_layers, max_batch, 2, n_kv, max_context, hs) pageable, pre-allocated at max capacity
    staging   (max_batch, 2, n_kv, max_context, hs) ONE page-locked max-capacity buffer
    device    (max_batch, 2, n_kv, max_context, hs) the transfer target

Each layer of each step splices every sequence's valid rows from the host buffer into the staging
buffer, copies the slice [:B, :, :, :L_max] to the device (strided: every head row is followed by
the unused capacity, so the DMA cannot be one transfer), attends there, and writes the new tokens
back to the host. The staging buffer is shared by all layers, so the next layer's splice waits
until the last transfer has read it. All of the KV is attended on the GPU (r = 0). Attention sinks
(gpt-oss) scale the merged output by σ(lse − s) once, as the resident KV does.
"""

from __future__ import annotations

import heapq
import math

import torch

from engine.errors import ContextOverflowError, OutOfMemoryError
from engine.kernels.attention_gpu import attend_dense, attend_padded, padding_mask, sink_scale
from engine.kernels.lse import merge_pair
from engine.kv.backend import KVBackend
from engine.kv.transport import Transport


class MonolithicKV(KVBackend):
    policy = "monolithic"
    supports_sinks = True  # attend's sinks; window layers stay resident (kv/layer_split.py)

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, max_context: int, max_batch: int,
                 device: torch.device, dtype: torch.dtype):
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self._allocate(n_layers, max_context=max_context, max_batch=max_batch, device=device, dtype=dtype)

    def _buffer_shape(self, max_batch: int, max_context: int) -> tuple[int, ...]:
        """One layer's buffer for every slot (staging and device; the host holds one per layer):
        per-head K and V planes, each token's rows strided by max_context."""
        return (max_batch, 2, self.n_kv_heads, max_context, self.head_dim)

    def _allocate(self, n_layers: int, *, max_context: int, max_batch: int, device: torch.device,
                  dtype: torch.dtype) -> None:
        """The buffers of _buffer_shape, the staging event, and the sequence slots."""
        self.transport = Transport(device)
        self.device, self.dtype, self.max_context = device, dtype, max_context
        shape = self._buffer_shape(max_batch, max_context)
        per_token = math.prod(shape) // (max_batch * max_context)  # elements of one token of one layer
        self.token_bytes = per_token * torch.empty((), dtype=dtype).element_size()  # per layer
        try:
            self.host = torch.empty((n_layers, *shape), dtype=dtype)
        except (RuntimeError, MemoryError) as e:  # pageable pages are committed when written, but the
            need = n_layers * max_batch * max_context * self.token_bytes  # address space must exist
            raise OutOfMemoryError(f"the monolithic host buffer ({need / 2**30:.1f} GiB) cannot be reserved",
                                   "lower max_context or max_batch") from e
        self.staging = self.transport.host(shape, dtype, pinned=True)
        self.staging.tensor.zero_()  # padded keys are masked, but their values must stay finite
        try:
            self.work = torch.empty(shape, device=device, dtype=dtype)
        except torch.OutOfMemoryError as e:
            raise OutOfMemoryError(f"the monolithic transfer buffer does not fit on {device}",
                                   "lower max_context or max_batch") from e
        self.copied = self.transport.event()  # the last H2D has read the staging buffer
        self.lengths: dict[int, int] = {}
        self.slot_of: dict[int, int] = {}
        self._free_slots = list(range(max_batch))
        self._next_id = 0
        self._step = None
        self.h2d_bytes = self.d2h_bytes = 0

    def _load_past(self, layer: int, slots: list[int], lengths: list[int]) -> torch.Tensor:
        """Splice every sequence's valid tokens of this layer into the staging buffer and copy the
        slice of the first max(lengths) tokens to the device → that view of the device buffer,
        _buffer_shape with B rows and L tokens (tokens are the second-to-last axis)."""
        B, L = len(slots), max(lengths)
        self.copied.synchronize()  # one staging buffer for every layer: the last copy must be done
        stage = self.staging.tensor
        for b, (slot, n) in enumerate(zip(slots, lengths)):
            if n:
                stage[b].narrow(-2, 0, n).copy_(self.host[layer, slot].narrow(-2, 0, n))
        past = self.work[:B].narrow(-2, 0, L)
        past.copy_(stage[:B].narrow(-2, 0, L), non_blocking=True)  # a strided slice: no single DMA
        self.copied.record()
        self.h2d_bytes += B * L * self.token_bytes
        return past

    def new_sequence(self) -> int:
        if not self._free_slots:
            raise OutOfMemoryError("all KV sequence slots are in use", "end a chat or raise max_batch")
        sid, self._next_id = self._next_id, self._next_id + 1
        self.slot_of[sid] = heapq.heappop(self._free_slots)
        self.lengths[sid] = 0
        return sid

    def free(self, seq_id: int) -> None:
        heapq.heappush(self._free_slots, self.slot_of.pop(seq_id))
        del self.lengths[seq_id]

    def crop(self, seq_id: int, n_tokens: int) -> None:
        self.lengths[seq_id] = min(self.lengths[seq_id], n_tokens)

    def length(self, seq_id: int) -> int:
        return self.lengths[seq_id]

    def begin_step(self, seq_ids: list[int], n_new: int) -> torch.Tensor:
        lengths = [self.lengths[s] for s in seq_ids]
        if max(lengths) + n_new > self.max_context:
            raise ContextOverflowError(f"{max(lengths) + n_new} tokens exceed the context window of {self.max_context}",
                                       "start a new chat, shorten the prompt, or raise max_context")
        L = max(lengths)
        excluded = padding_mask(torch.tensor(lengths, device=self.device), L) if L and min(lengths) != L else None
        self._step = (seq_ids, [self.slot_of[s] for s in seq_ids], lengths, n_new, excluded)
        return (torch.tensor(lengths)[:, None] + torch.arange(n_new)).to(self.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        """sinks (nh,): per-head sink logits, or None. window: one that binds within max_context is
        refused (such a layer keeps its KV resident)."""
        if window is not None and window < self.max_context:  # a window that hides no key is full attention
            raise ValueError(f"layer {layer}: monolithic attends over every past key; a {window}-token "
                             "window layer belongs in the resident part (engine/kv/layer_split.py)")
        _, slots, lengths, T, excluded = self._step
        B, _, _, hs = q.shape
        scale = hs ** -0.5
        out, lse = attend_dense(q, k, v, scale, causal=T > 1)  # the new tokens
        L = max(lengths)
        if L:
            past = self._load_past(layer, slots, lengths)  # (B, 2, n_kv, L, hs)
            if excluded is None:
                o2, l2 = attend_dense(q, past[:, 0], past[:, 1], scale)
            else:
                o2, l2 = attend_padded(q, past[:, 0], past[:, 1], excluded, scale)
            out, lse = merge_pair(out, lse, o2, l2)
        for b, (slot, n) in enumerate(zip(slots, lengths)):  # write the new tokens back to the host
            self.host[layer, slot, 0, :, n:n + T].copy_(k[b])
            self.host[layer, slot, 1, :, n:n + T].copy_(v[b])
        self.d2h_bytes += B * T * self.token_bytes
        if sinks is not None:  # (B, nh, T, hs) · σ(lse − s) over the new and the past keys together
            out = out * sink_scale(lse, sinks[:, None]).unsqueeze(-1)
        return out.to(q.dtype)

    def end_step(self) -> None:
        seq_ids, _, _, T, _ = self._step
        for s in seq_ids:
            self.lengths[s] += T
        self._step = None

    def telemetry(self) -> dict:
        tokens = sum(self.lengths.values())
        return {
            "policy": self.policy,
            "simulated": not self.transport.cuda,
            "bytes": {"kv_pingpong": self.work.numel() * self.work.element_size(),  # the device transfer buffer
                      "kv_pinned": self.staging.nbytes,
                      "kv_unpinned": tokens * self.token_bytes * self.host.shape[0]},
            "tokens": {"unpinned": tokens},
            "r_target": None,
            "r_deployed": 0.0,  # every key is attended on the GPU
            "pcie": {"h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes},
        }

    def close(self) -> None:
        self.transport.synchronize()
        self.staging.release()
