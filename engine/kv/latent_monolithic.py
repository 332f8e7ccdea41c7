"""The monolithic comparison policy over latent rows (DeepSeek-V2's MLA): MonolithicKV's buffers and
step, one row per token and layer instead of per-head K and V.

    host      (n_layers, max_batch, max_context, r + dr) pageable, pre-allocated at max capacity
    staging   (max_batch, max_context, r + dr) ONE page-locked max-capacity buffer
    device    (max_batch, max_context, r + dr) the transfer target

As in engine/kv/monolithic.py, each layer of each step splices every sequence's valid rows from the
host buffer into the staging buffer, copies the slice [:B, :L_max] to the device (strided: each
sequence's rows are followed by its unused capacity), attends there and writes the new rows back to
the host; all of the KV is attended on the GPU (r = 0). Sequences, slots and steps are
MonolithicKV's; only the buffers and the attention differ. The attention is the absorbed one of
engine/kernels/attention_mla.py: the values are each row's first r columns, so there is no V plane,
and the model hands its softmax scale (engine/models/mla.py: `attend(layer, q, k, None, scale=…)`).
"""

from __future__ import annotations

import torch

from engine.kernels import attention_mla
from engine.kernels.lse import merge_pair
from engine.kv.monolithic import MonolithicKV


class LatentMonolithicKV(MonolithicKV):
    supports_sliding_window = False
    supports_sinks = False

    def __init__(self, n_layers: int, row_width: int, value_dim: int, *, max_context: int, max_batch: int,
                 device: torch.device, dtype: torch.dtype):
        """row_width: r + dr columns per token row; value_dim: r, the columns that are the values."""
        self.row_width, self.value_dim = row_width, value_dim
        self._allocate(n_layers, max_context=max_context, max_batch=max_batch, device=device, dtype=dtype)

    def _buffer_shape(self, max_batch: int, max_context: int) -> tuple[int, ...]:
        """One row per token: no V plane, each sequence's rows followed by its unused capacity."""
        return (max_batch, max_context, self.row_width)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: None = None, *,
               scale: float) -> torch.Tensor:
        """q: (B, nh, T, r + dr) absorbed queries; k: (B, 1, T, r + dr) the new rows; v: None
        → attended latents (B, nh, T, r) in q's dtype."""
        if v is not None:
            raise ValueError("latent KV rows carry their values; attend takes v=None")
        _, slots, lengths, T, excluded = self._step
        B = q.shape[0]
        # the new rows over themselves: query i of a prefill sees rows ≤ i (bottom-right causal)
        out, lse = attention_mla.latent_attention_planes(q, k, None, self.value_dim, scale, causal=k.shape[2] > 1)
        L = max(lengths)
        if L:
            past = self._load_past(layer, slots, lengths)  # (B, L, r + dr)
            visible = None if excluded is None else ~excluded  # (B, 1, 1, L): True for each row's own keys
            o2, l2 = attention_mla.latent_attention(q, past, self.value_dim, scale, visible)
            out, lse = merge_pair(out, lse, o2, l2)
        for b, (slot, n) in enumerate(zip(slots, lengths)):  # write the new rows back to the host
            self.host[layer, slot, n:n + T].copy_(k[b, 0])
        self.d2h_bytes += B * T * self.token_bytes
        return out.to(q.dtype)
