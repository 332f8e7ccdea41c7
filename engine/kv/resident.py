"""Resident KV: every block on the compute device, allocated once up front.

The pools hold max_batch × max_context tokens per layer; sequences take blocks from a free list,
so a step never reallocates. A decode step (one new token per sequence) on CUDA reads the keys in
place through the block table (engine/kernels/paged_attention_gpu.py); its inputs (write slots,
positions, key counts, block table) live in one device buffer at fixed addresses, filled by one copy
per step, so a CUDA graph of the decode step (engine/runtime/decode_graph.py) can replay it. Otherwise — prefill chunks,
the CPU — attention gathers each sequence's blocks and runs SDPA with a mask (padding for batches of
unequal lengths, causal for prefill, and a sliding window when the model has one: a query at
position p sees keys p−window+1 … p, as transformers' sliding-window mask).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.errors import ContextOverflowError, OutOfMemoryError
from engine.kernels import attention_gpu, attention_native, paged_attention_gpu
from engine.kv.backend import KVBackend
from engine.kv.regions import BlockAllocator, SequenceBlocks


class ResidentKV(KVBackend):
    policy = "resident"
    supports_sliding_window = True
    supports_sinks = True  # and a window per layer (attend's sinks, window)

    @property
    def flash_prefill(self) -> bool:
        # flash: SDPA's, causal or with the bottom-right bias (`_step_mask`); with a window or sinks,
        # `attention_gpu.flash_causal` (sinks through its LSE)
        return attention_gpu.flash_supports(self.device, self.k.dtype, self.k.shape[-1])

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, max_context: int,
                 max_batch: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 sliding_window: int | None = None, paged_decode: bool | None = None):
        """dtype: the rows' (the CPU's default cache holds fp16 rows beside fp32 compute:
        engine/runtime/kv_setup.py `kv_dtype`); paged_decode: None picks the paged kernel wherever it
        runs (CUDA with Triton)."""
        self.max_context, self.block_size, self.device = max_context, block_size, device
        self.n_kv_heads = n_kv_heads
        if paged_decode is None:  # the kernel tiles head dims that are powers of two, ≥ 16
            paged_decode = paged_attention_gpu.available(device) and paged_attention_gpu.supports_head_dim(head_dim)
        self.paged = paged_decode
        self.window = sliding_window  # None: every past key is visible
        blocks_per_seq = -(-max_context // block_size)
        n_blocks = blocks_per_seq * max_batch
        n_slots = n_blocks * block_size
        try:  # (L, slots, n_kv, hs) each; empty: host pages are committed only when written
            self.k = torch.empty((n_layers, n_slots, n_kv_heads, head_dim), device=device, dtype=dtype)
            self.v = torch.empty_like(self.k)
        except torch.OutOfMemoryError as e:
            raise OutOfMemoryError(
                f"cannot allocate the resident KV cache ({2 * self.k_bytes_for(n_layers, n_slots, n_kv_heads, head_dim, dtype) / 2**30:.2f} GiB) on {device}",
                "lower max_context or max_batch, or choose a hybrid kv_policy",
            ) from e
        self.allocator = BlockAllocator(n_blocks)
        self.seqs: dict[int, SequenceBlocks] = {}
        self._next_id = 0
        self._step = self._paged_step = None
        self.max_batch, self.blocks_per_seq = max_batch, blocks_per_seq
        if self.paged:  # [write slot | position | keys | block table row] per sequence, int64
            n = max_batch * (3 + blocks_per_seq)
            self._decode_host = torch.zeros(n, dtype=torch.int64, pin_memory=device.type == "cuda")
            self._decode_np = self._decode_host.numpy()  # the same memory, written element by element
            self._decode_dev = torch.zeros(n, dtype=torch.int64, device=device)
            self._decode_copied = None  # CUDA event: the last copy out of _decode_host is done
            self._scratch: dict[int, tuple] = {}  # batch size → the paged kernel's partials (fixed addresses)

    @staticmethod
    def k_bytes_for(n_layers, n_slots, n_kv_heads, head_dim, dtype) -> int:
        return n_layers * n_slots * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    # -- sequences ----------------------------------------------------------------------------
    def new_sequence(self) -> int:
        sid = self._next_id
        self._next_id += 1
        self.seqs[sid] = SequenceBlocks(self.block_size)
        return sid

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        self.allocator.release(seq.blocks)

    def crop(self, seq_id: int, n_tokens: int) -> None:
        self.seqs[seq_id].crop(n_tokens, self.allocator)

    def length(self, seq_id: int) -> int:
        return self.seqs[seq_id].length

    # -- one forward step ---------------------------------------------------------------------
    def begin_step(self, seq_ids: list[int], n_new: int) -> torch.Tensor:
        seqs = [self.seqs[s] for s in seq_ids]
        for s in seqs:
            if s.length + n_new > self.max_context:
                raise ContextOverflowError(
                    f"{s.length + n_new} tokens exceed the context window of {self.max_context}",
                    "start a new chat, shorten the prompt, or raise max_context",
                )
            s.ensure(s.length + n_new, self.allocator)
        lengths = [s.length for s in seqs]
        fresh = len(seqs) == 1 and lengths[0] == 0  # prefill from empty: attend to k, v directly
        if self.paged and n_new == 1 and not fresh:
            return self._begin_paged_decode(seqs)
        self._paged_step = None
        total = max(lengths) + n_new  # S: keys per sequence after the step, padded to the longest
        write = torch.cat([s.slots(s.length, s.length + n_new) for s in seqs])  # (B·T,)
        write = _contiguous(write) or write.to(self.device)
        positions = (torch.tensor(lengths)[:, None] + torch.arange(n_new)).to(self.device)  # (B, T)
        read = None
        if not fresh:
            read = _contiguous(seqs[0].slots(0, total)) if len(seqs) == 1 else None
            if read is None:
                read = torch.stack([F.pad(s.slots(0, s.length + n_new), (0, total - s.length - n_new))
                                    for s in seqs])  # (B, S): padding points at slot 0, masked out
                read = read.to(self.device)
        self._mask_args = (fresh, lengths, n_new, total)
        # window → this step's mask; a layer whose window differs adds its own at its first attend
        self._masks = {self.window: self._step_mask(self.window)}
        self._step = (seqs, n_new, write, read)
        return positions

    def _step_mask(self, window: int | None) -> torch.Tensor | None:
        """The begun step's mask under `window`: None when plain causal (or no) masking does, SDPA's
        bottom-right causal bias for a chunk after earlier ones on CUDA, else a boolean (B, 1, T, S − cut)
        over the keys from `_step_cut(window)` on."""
        fresh, lengths, n_new, total = self._mask_args
        if fresh:
            if window is None or n_new <= window:
                return None
            pos = torch.arange(n_new)  # prefill longer than the window
            mask = ((pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window))[None, None]
            return mask.to(self.device)  # (1, 1, T, T)
        if len(set(lengths)) == 1 and (window is None or total <= window):  # no padding, no window cut
            if n_new == 1:
                return None  # one query a sequence: every key visible
            if self.device.type == "cuda":
                # a chunk after earlier ones: query i sees keys ≤ S − T + i, causal aligned at the bottom
                # right, which SDPA's flash kernel takes as such (with GQA); a boolean (T, S) mask would send
                # it to the math backend's fp32 scores, (nh, T, S) floats a layer. (Imported here: the module
                # imports torch._dynamo, ~1.6 s, which a model's load and the CPU need not pay.)
                from torch.nn.attention.bias import causal_lower_right

                return causal_lower_right(n_new, total)
        key_pos = torch.arange(self._step_cut(window), total)  # (S − cut,)
        query_pos = torch.tensor(lengths)[:, None] + torch.arange(n_new)  # (B, T)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # (B, T, S)
        if window is not None:
            mask &= key_pos[None, None, :] > query_pos[:, :, None] - window
        return mask.unsqueeze(1).to(self.device)  # (B, 1, T, S − cut)

    def _step_cut(self, window: int | None) -> int:
        """Keys at the front of one sequence's begun step that no query sees under `window` (the first
        query, at position S − T, sees keys from S − T − window + 1 on): left unread, not masked. 0
        where nothing is cut, and for a batch (its rows are padded to one length)."""
        fresh, lengths, n_new, total = self._mask_args
        if window is None or fresh or len(lengths) != 1:
            return 0
        return max(0, total - n_new - window + 1)

    def _begin_paged_decode(self, seqs: list[SequenceBlocks]) -> torch.Tensor:
        """Fill the step buffer and hand out views of it: the same addresses every step of a batch size."""
        B, mb, W, bs = len(seqs), self.max_batch, self.blocks_per_seq, self.block_size
        if self._decode_copied is not None:  # the last step's copy must have read the host buffer
            self._decode_copied.synchronize()
        host = self._decode_np
        for b, s in enumerate(seqs):
            n = s.length
            host[b] = s.blocks[n // bs] * bs + n % bs  # slot of the new token's K, V
            host[mb + b] = n  # its position
            host[2 * mb + b] = n + 1  # keys it attends to, itself included
            host[3 * mb + b * W:3 * mb + b * W + len(s.blocks)] = s.blocks
        dev = self._decode_dev
        dev.copy_(self._decode_host, non_blocking=True)  # one H2D copy per step
        if self.device.type == "cuda":
            self._decode_copied = torch.cuda.Event()
            self._decode_copied.record()
        if B not in self._scratch:
            self._scratch[B] = (paged_attention_gpu.split_count(self.max_context, B, self.n_kv_heads, self.device), None)
        self._step = (seqs, 1, dev[:B], None)
        self._paged_step = (dev[3 * mb:].view(mb, W)[:B], dev[2 * mb:2 * mb + B])  # (B, W) table, (B,) keys
        return dev[mb:mb + B].view(B, 1)  # (B, 1) positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None, window: int | None | str = "model") -> torch.Tensor:
        """Store this step's k, v and attend over the sequence so far: (B, nh, T, hs).

        sinks (nh,): per-head sink logits (gpt-oss): the paged decode rescales its output by them
        through its LSE, the gathering paths put the sink into the softmax. window: this layer's own
        sliding window (None: full attention) where layers differ; "model": the cache's window."""
        window = self.window if window == "model" else window
        seqs, n_new, write, read = self._step
        B, _, T, hs = q.shape
        if k is not None:  # None: the projection stored them (decode_store); rounded to the cache's dtype
            self.k[layer][write] = k.transpose(1, 2).reshape(B * T, self.n_kv_heads, hs).to(self.k.dtype)
            self.v[layer][write] = v.transpose(1, 2).reshape(B * T, self.n_kv_heads, hs).to(self.v.dtype)
        if self._paged_step is not None:
            table, keys = self._paged_step
            splits, scratch = self._scratch[B]
            if scratch is None:  # first step of this batch size: one set of partials for every layer and step
                scratch = paged_attention_gpu.scratch_for(B, q.shape[1], hs, splits, self.device)
                self._scratch[B] = (splits, scratch)
            o, lse = paged_attention_gpu.paged_decode(
                q[:, :, 0], self.k[layer], self.v[layer], table, keys, self.block_size,
                hs ** -0.5, splits, window=window, scratch=scratch,
                out=q.new_empty(B, q.shape[1], hs))  # (B, nh, hs) in q's dtype
            if sinks is not None:  # (B, nh, hs) · σ(lse − s)
                o = o * attention_gpu.sink_scale(lse, sinks).unsqueeze(-1).to(o.dtype)
            return o.unsqueeze(2)  # (B, nh, 1, hs)
        if window is not None and T > 1 and B == 1 and self.flash_prefill and q.dtype == self.k.dtype:
            keys, values = self._read(layer, k, v, read, window, q.dtype)  # one sequence: no padding
            return attention_gpu.flash_causal(q, keys, values, window, sinks)
        if window not in self._masks:
            self._masks[window] = self._step_mask(window)
        mask = self._masks[window]
        if isinstance(read, slice) and T == 1 and mask is None and sinks is None and self.device.type == "cpu":
            # one chat's decode on the CPU: the native kernel reads the rows in place, no gather and no mask
            out = attention_native.attend_rows(q, self.k[layer], self.v[layer], read, hs ** -0.5)
            if out is not None:
                return out
        keys, values = self._read(layer, k, v, read, window, q.dtype)
        if sinks is not None:  # the sink is a key of its own (causal: still bottom-right aligned)
            return attention_gpu.sdpa_with_sinks(q, keys, values, sinks, mask)
        return attention_gpu.sdpa(q, keys, values, mask, causal=mask is None and T > 1)

    def _read(self, layer: int, k, v, read, window: int | None, dtype: torch.dtype):
        """The keys and values the begun step attends over: this step's own (prefill from empty) or the
        cache's rows from `_step_cut(window)` on → (B, n_kv, S, hs) each, in `dtype`."""
        if read is None:
            return k, v  # (B, n_kv, T, hs): prefill from empty
        cut = self._step_cut(window)
        if cut:  # keys older than every query's window (the mask starts after them too)
            read = _rows_from(read, cut)
        return (read_rows(self.k[layer], read).transpose(1, 2).to(dtype),  # (B, n_kv, S, hs)
                read_rows(self.v[layer], read).transpose(1, 2).to(dtype))

    def decode_store(self, layer: int):
        """A paged decode step's rows (the step buffer's write slots, fixed addresses for a graph)."""
        if self._paged_step is None:
            return None
        return self.k[layer], self.v[layer], self._step[2]

    def decode_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The begun step as rows of each layer's cache where it is a decode step on the CPU (one token a
        sequence) that no window cuts: (write_rows (B,), runs (R, 2), offsets (B + 1,)), int64 each.
        Sequence b's token goes to row write_rows[b]; its rows, this token's included, are runs
        [offsets[b], offsets[b + 1]) of consecutive slots (first, count), in order. A native layer step
        reads and writes them in place (engine/runtime/cpu_decode.py). None otherwise."""
        if self._step is None or self._paged_step is not None or self.device.type != "cpu":
            return None
        seqs, n_new, _, _ = self._step
        if n_new != 1 or (self.window is not None and any(s.length >= self.window for s in seqs)):
            return None
        bs, writes, runs = self.block_size, [], []
        for seq in seqs:
            n = seq.length + 1  # keys after the step
            blocks = np.asarray(seq.blocks[:-(-n // bs)], dtype=np.int64)  # (nb,) in position order
            starts = np.flatnonzero(np.diff(blocks, prepend=-2) != 1)  # the blocks that begin a run
            counts = np.diff(starts, append=len(blocks)) * bs
            counts[-1] -= len(blocks) * bs - n  # the last block's slots after this token
            writes.append(int(blocks[-1]) * bs + (n - 1) % bs)
            runs.append(np.stack((blocks[starts] * bs, counts), axis=1))
        offsets = np.cumsum([0] + [len(r) for r in runs], dtype=np.int64)
        return np.array(writes, dtype=np.int64), np.concatenate(runs), offsets

    def replayable_step(self) -> bool:
        """Whether the step begun is a paged decode: inputs at fixed addresses, a CUDA graph can replay it."""
        return self._paged_step is not None

    def end_step(self) -> None:
        seqs, n_new = self._step[0], self._step[1]
        for s in seqs:
            s.length += n_new
        self._step = self._paged_step = None

    def telemetry(self) -> dict:
        nbytes = self.k.numel() * self.k.element_size() * 2
        return {
            "policy": self.policy,
            "bytes": {"kv_resident": nbytes},
            "tokens": {"resident": sum(s.length for s in self.seqs.values())},
        }


def read_rows(cache: torch.Tensor, read: torch.Tensor | slice) -> torch.Tensor:
    """A layer's cache (slots, …) → the step's past rows (B, S, …): gathered (a copy) through (B, S)
    slot indices, or in place (a view, B = 1) through a slice."""
    return cache[read].unsqueeze(0) if isinstance(read, slice) else cache[read]


def _rows_from(read: torch.Tensor | slice, cut: int) -> torch.Tensor | slice:
    """The step's rows (a slice, or (B, S) slot indices) without their first `cut`."""
    return slice(read.start + cut, read.stop) if isinstance(read, slice) else read[:, cut:]


def _contiguous(slots: torch.Tensor) -> slice | None:
    """slots (n,) as a slice when they are consecutive: the cache is then read and written in place
    (a view) instead of gathered, which at 2K tokens of the built-in model is 94 MB copied a token."""
    first, n = int(slots[0]), slots.numel()
    if int(slots[-1]) - first != n - 1 or (n > 2 and not bool((slots.diff() == 1).all())):
        return None
    return slice(first, first + n)
