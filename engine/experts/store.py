"""The host expert store: every routed expert's weights in host memory, one contiguous block each.

Block layout (P = 3·I·H elements, the engine's dtype): [gate_up (2I, H) row-major | down (H, I)
row-major], the fused transformers layout of one expert. One block is one DMA into a GPU cache
slot, which has the same layout, and the CPU computes on the block in place through two views.

All blocks live in one (n_blocks, P) allocation on transparent huge pages where Linux has them (the
CPU streams each block from DRAM: `hostmem.large_host_tensor`), pinned where CUDA exists by registering that
ordinary memory with `cudaHostRegister` (exact size; `pin_memory=True` would round 58 GB up to
64 GB) and unregistered before it is freed. The CPU reads pinned pages no slower than pageable ones
(CPU attention: 3.5 ms pinned vs 3.9 ms pageable), so it computes from the same pinned blocks;
`engine.bench.experts.pinning_penalty` re-measures it for the expert FFN.

Experts that are views of the same memory (the built-in upcycled model: 8 stride-0 copies of each
layer's FFN) share one block: (layer, expert) → block is a table, so fills, LRU and CPU execution
work per (layer, expert) exactly as with distinct experts while the host keeps one copy.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from engine.errors import ModelFileError
from engine.hw.hostmem import HUGE_PAGE, huge_page_eligible, large_host_tensor


def _unregister(ptr: int, keepalive: torch.Tensor) -> None:
    """Unpin before the memory is freed (keepalive holds the buffer until this has run)."""
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))
    except Exception:  # interpreter shutdown: the driver may be gone already
        pass


class ExpertStore:
    def __init__(self, block_of: np.ndarray, n_blocks: int, hidden: int, expert_ffn: int, dtype: torch.dtype,
                 pin: bool = False):
        """block_of: (n_layers, E) block index of each (layer, expert), −1 for layers without routed
        experts. Blocks are allocated here (uninitialised) and filled by `write`."""
        self.block_of = np.asarray(block_of, dtype=np.int64)  # (L, E)
        self.n_layers, self.n_experts = self.block_of.shape
        self.hidden, self.expert_ffn, self.dtype = hidden, expert_ffn, dtype
        self.layers = [l for l in range(self.n_layers) if (self.block_of[l] >= 0).any()]  # MoE layers
        self.block_numel = 3 * hidden * expert_ffn  # P
        self._split = 2 * expert_ffn * hidden
        self.blocks = large_host_tensor((n_blocks, self.block_numel), dtype)  # (n_blocks, P), host, huge pages
        # Views made once per block: the decode path asks for a dozen per layer step, ~5 µs each to make.
        self._block_views: dict[int, torch.Tensor] = {}
        self._expert_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._moe_rows: np.ndarray | None = None  # (L, E, 5) int64, see moe_table
        self.huge_pages = self.nbytes >= HUGE_PAGE and bool(huge_page_eligible(self.blocks))
        self.pinned = False
        self._finalizer = None
        if pin and torch.cuda.is_available() and self.blocks.numel():
            ptr = self.blocks.data_ptr()
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, 0))
            self.pinned = True
            self._finalizer = weakref.finalize(self, _unregister, ptr, self.blocks)

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def from_layers(cls, gate_up: list[torch.Tensor | None], down: list[torch.Tensor | None], *,
                    dtype: torch.dtype, pin: bool = False) -> "ExpertStore":
        """Per layer fused (E, 2I, H) and (E, H, I) tensors (None: a layer without routed experts),
        any device or dtype → a store in `dtype`. Storage-sharing experts share a block."""
        layers = [l for l, t in enumerate(gate_up) if t is not None]
        if not layers:
            raise ModelFileError("the model has no routed experts to store", "use expert_policy resident")
        E, two_i, H = gate_up[layers[0]].shape
        I = two_i // 2
        block_of = np.full((len(gate_up), E), -1, dtype=np.int64)
        firsts: dict[tuple, int] = {}
        sources: list[tuple[int, int]] = []  # (layer, expert) whose weights fill each block
        for l in layers:
            gu, dn = gate_up[l], down[l]
            if tuple(gu.shape) != (E, 2 * I, H) or dn is None or tuple(dn.shape) != (E, H, I):
                raise ModelFileError(f"layer {l}: expert tensors of shapes {tuple(gu.shape)} / "
                                     f"{None if dn is None else tuple(dn.shape)} do not match ({E}, {2 * I}, {H})",
                                     "the weights do not match the config")
            for e in range(E):
                a, b = gu[e], dn[e]
                key = (a.device, a.data_ptr(), a.stride(), b.data_ptr(), b.stride(), a.dtype)
                if key not in firsts:
                    firsts[key] = len(sources)
                    sources.append((l, e))
                block_of[l, e] = firsts[key]
        store = cls(block_of, len(sources), H, I, dtype, pin)
        for i, (l, e) in enumerate(sources):
            store._write_block(i, gate_up[l][e], down[l][e])
        return store

    def _write_block(self, index: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        block = self.blocks[index]
        block[:self._split].view(2 * self.expert_ffn, self.hidden).copy_(gate_up)
        block[self._split:].view(self.hidden, self.expert_ffn).copy_(down)

    def write(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Fill one expert's block: (2I, H) and (H, I), any dtype (for loaders that generate or
        read experts one at a time straight into the store)."""
        self._write_block(int(self.block_of[layer, expert]), gate_up, down)

    @classmethod
    def empty(cls, n_layers: int, moe_layers: list[int], n_experts: int, hidden: int, expert_ffn: int,
              dtype: torch.dtype, pin: bool = False) -> "ExpertStore":
        """One distinct block per (layer, expert) of the MoE layers, to be filled with `write`."""
        block_of = np.full((n_layers, n_experts), -1, dtype=np.int64)
        for i, l in enumerate(moe_layers):
            block_of[l] = np.arange(i * n_experts, (i + 1) * n_experts)
        return cls(block_of, len(moe_layers) * n_experts, hidden, expert_ffn, dtype, pin)

    # -- access ---------------------------------------------------------------------------------
    def block(self, layer: int, expert: int) -> torch.Tensor:
        """The expert's contiguous block (P,): the source of one DMA."""
        index = int(self.block_of[layer, expert])
        view = self._block_views.get(index)
        if view is None:
            view = self._block_views[index] = self.blocks[index]
        return view

    def expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (2I, H), (H, I) of the expert's block, for in-place CPU compute."""
        index = int(self.block_of[layer, expert])
        views = self._expert_views.get(index)
        if views is None:
            block = self.block(layer, expert)
            views = self._expert_views[index] = (block[:self._split].view(2 * self.expert_ffn, self.hidden),
                                                 block[self._split:].view(self.hidden, self.expert_ffn))
        return views

    def moe_table(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Rows of the native moe_ffn table for these experts, (J, 5) int64 (a new array): gate_up
        address, down address, their row strides in elements (H, I), and 0 pairs for the caller to
        fill. Read from a table of every expert made at the first call (the blocks never move), so a
        decode layer's CPU set costs one indexing here, not a tensor view per expert."""
        return self.moe_rows(layer)[experts]

    def moe_rows(self, layer: int) -> np.ndarray:
        """The layer's rows of that table for every expert, (E, 5) int64, C-contiguous (a view: do not
        write). Rows of experts the store does not serve are all zero."""
        return self.all_moe_rows()[layer]

    def all_moe_rows(self) -> np.ndarray:
        """Every layer's rows, (n_layers, E, 5) int64 (do not write)."""
        if self._moe_rows is None:
            first = self.blocks.data_ptr() + np.maximum(self.block_of, 0) * self.block_bytes  # (L, E)
            rows = np.zeros(self.block_of.shape + (5,), dtype=np.int64)
            rows[..., 0] = first
            rows[..., 1] = first + self._split * self.blocks.element_size()
            rows[..., 2] = self.hidden
            rows[..., 3] = self.expert_ffn
            rows[self.block_of < 0] = 0  # layers without routed experts: no address at all
            self._moe_rows = rows
        return self._moe_rows

    @property
    def block_bytes(self) -> int:
        return self.block_numel * self.blocks.element_size()

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    @property
    def n_routed(self) -> int:
        """(layer, expert) pairs the store serves (more than its blocks when experts share one)."""
        return int((self.block_of >= 0).sum())

    def close(self) -> None:
        """Unpin now (the caller has finished every copy that reads the store)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
            self.pinned = False
