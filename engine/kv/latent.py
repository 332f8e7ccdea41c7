"""Resident KV of K-only rows: multi-head latent attention (DeepSeek-V2) on the compute device.

One row per token and layer, [latent c (r), RoPE key (dr)], shared by every head; the values are the
row's first r columns, so no V pool exists (engine/models/mla.py says why the model hands it over as
`attend(layer, q_rows, k_rows, None, scale=…)`). Blocks, sequences, steps and masks are ResidentKV's;
only the pool and the attention differ:

  - decode (one query per sequence): the absorbed kernel (engine/kernels/attention_mla.py) over the
    gathered rows, which also yields the LSE a split of the sequence would merge by;
  - prefill chunks: SDPA over the same rows with the values as a view of their first r columns (a
    fused kernel: the decode kernel materialises T × S scores).

The paged CUDA decode kernel needs V of K's width and is not used; decode gathers the rows instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.errors import OutOfMemoryError
from engine.kernels import attention_mla
from engine.kv.regions import BlockAllocator
from engine.kv.resident import ResidentKV


class LatentResidentKV(ResidentKV):
    policy = "resident"
    supports_sliding_window = False
    supports_sinks = False

    def __init__(self, n_layers: int, row_width: int, value_dim: int, *, max_context: int, max_batch: int,
                 block_size: int, device: torch.device, dtype: torch.dtype):
        """row_width: r + dr columns per token row; value_dim: r, the columns that are the values."""
        self.max_context, self.block_size, self.device = max_context, block_size, device
        self.n_kv_heads, self.value_dim = 1, value_dim
        self.paged, self.window = False, None
        blocks_per_seq = -(-max_context // block_size)
        n_blocks = blocks_per_seq * max_batch
        n_slots = n_blocks * block_size
        try:  # (L, slots, 1, r + dr); empty: host pages are committed only when written
            self.k = torch.empty((n_layers, n_slots, 1, row_width), device=device, dtype=dtype)
        except torch.OutOfMemoryError as e:
            need = self.k_bytes_for(n_layers, n_slots, 1, row_width, dtype)
            raise OutOfMemoryError(f"cannot allocate the resident latent KV cache ({need / 2**30:.2f} GiB) on {device}",
                                   "lower max_context or max_batch") from e
        self.v = None  # the values live in the key rows
        self.allocator = BlockAllocator(n_blocks)
        self.seqs = {}
        self._next_id = 0
        self._step = self._paged_step = None
        self.max_batch, self.blocks_per_seq = max_batch, blocks_per_seq

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: None = None, *,
               scale: float) -> torch.Tensor:
        """q: (B, nh, T, r + dr) absorbed queries; k: (B, 1, T, r + dr) the new rows; v: None
        → attended latents (B, nh, T, r) in q's dtype."""
        if v is not None:
            raise ValueError("latent KV rows carry their values; attend takes v=None")
        seqs, n_new, write, read = self._step
        B, _, T, width = k.shape
        self.k[layer][write] = k.transpose(1, 2).reshape(B * T, 1, width)
        rows = k[:, 0] if read is None else self.k[layer][read][:, :, 0]  # (B, S, r + dr)
        mask = self._masks[None]  # (B, 1, T, S) or None: causal (prefill from empty) or every key
        if T == 1:
            o, _ = attention_mla.latent_attention(q, rows, self.value_dim, scale, mask)
            return o.to(q.dtype)
        keys = rows.unsqueeze(1)  # (B, 1, S, r + dr): one KV head for every query head
        values = keys[..., :self.value_dim]  # (B, 1, S, r): a view, no copy
        if mask is None:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)

    def telemetry(self) -> dict:
        return {
            "policy": self.policy,
            "bytes": {"kv_resident": self.k.numel() * self.k.element_size()},
            "tokens": {"resident": sum(s.length for s in self.seqs.values())},
        }
