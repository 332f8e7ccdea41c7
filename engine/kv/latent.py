"""Resident KV of K-only rows: multi-head latent attention (DeepSeek-V2) on the compute device.

One row per token and layer, [latent c (r), RoPE key (dr)], shared by every head; the values are the
row's first r columns, so no V pool exists (engine/models/mla.py says why the model hands it over as
`attend(layer, q_rows, k_rows, None, scale=…)`). Blocks, sequences, steps and masks are ResidentKV's;
only the pool and the attention differ:

  - decode (one query per sequence): the absorbed kernel (engine/kernels/attention_mla.py) over the
    gathered rows, which also yields the LSE a split of the sequence would merge by;
  - prefill chunks: SDPA over the same rows with the values as a view of their first r columns (a
    fused kernel: the decode kernel materialises T × S scores).

The paged CUDA decode kernel needs V of K's width and is not used. On CUDA a decode step instead
takes ResidentKV's step buffer (write slots, positions, key counts, block table at fixed addresses)
and gathers every block of each sequence's table, masked by its key count: fixed shapes, so the
runtime replays the step as a CUDA graph (engine/runtime/decode_graph.py), at the price of reading
max_context rows a step — bounded by GRAPH_MAX_CONTEXT.

The hybrid policies (`LatentWriteScopeKV`) keep the InplaceKVCache format exactly as it is: a row
of r + dr columns is stored as that format's "K" and "V" planes of (r + dr)/2 columns each (one KV
head), so every region, extent, DMA and byte count of the format applies unchanged and the rows
take r + dr values per token, as resident. Only the attention over each part differs: the absorbed
kernel reads the two planes in place, on the device side in torch
(attention_mla.latent_attention_planes) and on the CPU side natively (attention_mla_native: each row
read once for every head); the parts merge by LSE as any model's do.
"""

from __future__ import annotations

import torch

from engine.errors import OutOfMemoryError
from engine.kernels import attention_gpu, attention_mla, attention_mla_native
from engine.kv.regions import BlockAllocator
from engine.kv.resident import ResidentKV, read_rows
from engine.kv.writescope import WriteScopeKV


def format_shape(args) -> tuple[int, int]:
    """(n_kv, head_dim) of the KV format for a model's ModelArgs: its KV heads and head dim, or for
    latent rows (args.mla) one head of half a row (LatentWriteScopeKV's two planes)."""
    mla = getattr(args, "mla", None)
    return (args.n_kv_heads, args.head_dim) if mla is None else (1, LatentWriteScopeKV.plane_width(mla.row_width))


# Fixed-shape decode reads every row of max_context per layer and sequence: at 16K tokens of 576
# bf16 values that is 19 MB a layer (its fp32 copy twice that), well under a millisecond of an
# H200's bandwidth over 27 layers, against the launches a CUDA graph saves (an eager V2-Lite decode
# step took ~60 ms there). Longer contexts decode eagerly, reading only the rows in use.
GRAPH_MAX_CONTEXT = 16384


class LatentResidentKV(ResidentKV):
    policy = "resident"
    supports_sliding_window = False
    supports_sinks = False
    flash_prefill = False  # MLA's prefill attends over the latents in its own form (models/mla.py)

    def __init__(self, n_layers: int, row_width: int, value_dim: int, *, max_context: int, max_batch: int,
                 block_size: int, device: torch.device, dtype: torch.dtype, fixed_decode: bool | None = None):
        """row_width: r + dr columns per token row; value_dim: r, the columns that are the values.
        fixed_decode: decode steps at fixed addresses (graph-replayable); None: on CUDA up to
        GRAPH_MAX_CONTEXT."""
        self.max_context, self.block_size, self.device = max_context, block_size, device
        self.n_kv_heads, self.value_dim = 1, value_dim
        if fixed_decode is None:
            fixed_decode = device.type == "cuda" and max_context <= GRAPH_MAX_CONTEXT
        self.paged, self.window = fixed_decode, None  # `paged`: ResidentKV's name for the fixed-address step
        blocks_per_seq = -(-max_context // block_size)
        n_blocks = blocks_per_seq * max_batch
        n_slots = n_blocks * block_size
        # (L, slots, 1, r + dr); empty: host pages are committed only when written. Zeros where whole
        # tables are read: a masked key's probability is 0, and 0 · NaN of an unwritten slot is NaN
        alloc = torch.zeros if fixed_decode else torch.empty
        try:
            self.k = alloc((n_layers, n_slots, 1, row_width), device=device, dtype=dtype)
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
        if fixed_decode:  # ResidentKV's step buffer: [write slot | position | keys | block table row] per sequence
            n = max_batch * (3 + blocks_per_seq)
            self._decode_host = torch.zeros(n, dtype=torch.int64, pin_memory=device.type == "cuda")
            self._decode_np = self._decode_host.numpy()
            self._decode_dev = torch.zeros(n, dtype=torch.int64, device=device)
            self._decode_copied = None
            self._scratch = {b: (0, None) for b in range(1, max_batch + 1)}  # the paged kernel's: not used
            self._key_pos = torch.arange(blocks_per_seq * block_size, device=device)  # (W·bs,)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: None = None, *,
               scale: float) -> torch.Tensor:
        """q: (B, nh, T, r + dr) absorbed queries; k: (B, 1, T, r + dr) the new rows; v: None
        → attended latents (B, nh, T, r) in q's dtype."""
        if v is not None:
            raise ValueError("latent KV rows carry their values; attend takes v=None")
        seqs, n_new, write, read = self._step
        B, _, T, width = k.shape
        self.k[layer][write] = k.transpose(1, 2).reshape(B * T, 1, width)
        if self._paged_step is not None:  # fixed shapes: every block of each table, masked by its key count
            table, keys = self._paged_step  # (B, W), (B,)
            rows = self.k[layer].view(-1, self.block_size, width)[table].view(B, -1, width)  # (B, W·bs, r + dr)
            visible = (self._key_pos < keys[:, None]).view(B, 1, 1, -1)  # (B, 1, 1, W·bs)
            o, _ = attention_mla.latent_attention(q, rows, self.value_dim, scale, visible)
            return o.to(q.dtype)
        rows = k[:, 0] if read is None else read_rows(self.k[layer], read)[:, :, 0]  # (B, S, r + dr)
        mask = self._masks[None]  # (B, 1, T, S) or None: causal (prefill from empty) or every key
        if T == 1:
            o, _ = attention_mla.latent_attention(q, rows, self.value_dim, scale, mask)
            return o.to(q.dtype)
        keys = rows.unsqueeze(1)  # (B, 1, S, r + dr): one KV head for every query head
        values = keys[..., :self.value_dim]  # (B, 1, S, r): a view, no copy
        return attention_gpu.sdpa(q, keys, values, mask, causal=mask is None, scale=scale)

    def telemetry(self) -> dict:
        return {
            "policy": self.policy,
            "bytes": {"kv_resident": self.k.numel() * self.k.element_size()},
            "tokens": {"resident": sum(s.length for s in self.seqs.values())},
        }


class LatentWriteScopeKV(WriteScopeKV):
    """WriteScope over latent rows: each row's halves in the format's K and V planes (see above)."""

    def __init__(self, n_layers: int, row_width: int, value_dim: int, **kw):
        if row_width % 2:
            raise ValueError(f"a latent row of {row_width} columns does not split into two planes")
        self.half, self.value_dim = row_width // 2, value_dim
        self._cpu_native = False  # the last CPU share ran the native kernel (telemetry's cpu_kernel)
        super().__init__(n_layers, 1, row_width // 2, **kw)

    @staticmethod
    def plane_width(row_width: int) -> int:
        """The format's head dim for rows of this width (what PartitionSpec and its byte counts see)."""
        return row_width // 2

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: None = None, *,
               scale: float) -> torch.Tensor:
        """q: (B, nh, T, r + dr) absorbed queries; k: (B, 1, T, r + dr) the new rows; v: None
        → attended latents (B, nh, T, r)."""
        if v is not None:
            raise ValueError("latent KV rows carry their values; attend takes v=None")
        return super().attend(layer, q, k[..., :self.half], k[..., self.half:], scale=scale)

    def _out_width(self, q: torch.Tensor) -> int:
        return self.value_dim  # the attended latent, not the r + dr of q

    def device_part(self, q, k, v, scale, *, causal=False, excluded=None, fp32=True):
        """k, v: the two planes (b, 1, S, (r + dr)/2); excluded (b, 1, 1, S): True past a row's keys."""
        visible = None if excluded is None else ~excluded
        return attention_mla.latent_attention_planes(q, k, v, self.value_dim, scale, visible, causal)

    @property
    def query_width(self) -> int:
        return 2 * self.half  # an absorbed query row spans the whole latent row, r + dr

    def prepare_cpu(self, views, n_heads: int):
        """The CPU's share over the unpinned planes in place: the native MLA kernel reads each row once
        for every head (attention_mla_native; the torch path where the extension is missing)."""
        return attention_mla_native.prepare(views)

    def attend_cpu(self, q_host: torch.Tensor, blocks, scale: float, *, out=None, lse=None):
        self._cpu_native = attention_mla_native.runs_natively(blocks)
        return attention_mla_native.attend_latent_blocks(q_host, blocks, self.value_dim, scale, out=out, lse=lse)

    def telemetry(self) -> dict:
        ran, self._cpu_ran = self._cpu_ran, False  # the base names the per-head kernel, which did not run
        try:
            t = super().telemetry()
        finally:
            self._cpu_ran = ran
        t["cpu_kernel"] = ("native-mla" if self._cpu_native else "torch-mla") if ran else None
        return t
