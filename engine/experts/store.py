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

A GGUF's quantised experts stay quantised here (`from_quant_layers`): a block is then the expert's
bytes as the file has them, [gate rows | up rows | down rows] (uint8; a layer's three matrices may be
of different types, `QuantLayout`), so the host holds the file's size, not 3.5× it in BF16, a fill
moves the quantised bytes over PCIe, and the CPU computes over them in place (engine/quant's kernels).
GPU slots hold the same bytes: decode reads them in place (engine/kernels/quant_moe_gpu.py), larger
batches run GEMM kernels that decode them in registers (engine/kernels/quant_moe_gemm_gpu.py).
Blocks are as long as the longest layer's (Q4_K_M files give some layers' down rows Q6_K): a few % of
padding instead of a table of offsets.
"""

from __future__ import annotations

import logging
import weakref

import numpy as np
import torch

from engine.errors import ModelFileError
from engine.hw.hostmem import HUGE_PAGE, huge_page_eligible, large_host_tensor
from engine.quant.blocks import QuantRows, QuantStack, QuantTensor, dequantize_blocks_torch, qtype

log = logging.getLogger("tandem")


class QuantLayout:
    """Where one layer's quantised expert matrices sit in a block: gate (I, H), up (I, H), down (H, I),
    each (type code, rows, cols) at a byte offset, one after another."""

    def __init__(self, types: tuple[int, int, int], hidden: int, expert_ffn: int):
        self.hidden, self.expert_ffn = hidden, expert_ffn
        self.parts = []  # (type code, rows, cols, byte offset, bytes)
        offset = 0
        for code, (rows, cols) in zip(types, ((expert_ffn, hidden), (expert_ffn, hidden), (hidden, expert_ffn))):
            qt = qtype(code)
            if cols % qt.block_weights:
                raise ModelFileError(f"expert rows of {cols} weights are not whole {qt.name} blocks of "
                                     f"{qt.block_weights}", "the file is damaged: download or convert it again")
            nbytes = rows * (cols // qt.block_weights) * qt.block_bytes
            self.parts.append((code, rows, cols, offset, nbytes))
            offset += nbytes
        self.nbytes = offset

    @classmethod
    def of_expert(cls, gate_up, down: QuantTensor, hidden: int, expert_ffn: int) -> "QuantLayout":
        """The layout of one expert's matrices: gate_up a QuantRows of gate and up, or one QuantTensor."""
        return cls(_gate_up_types(gate_up) + (down.qtype.code,), hidden, expert_ffn)

    @property
    def kernel_parts(self) -> tuple[tuple[int, int], ...]:
        """(type code, byte offset) of gate, up and down: what the GPU kernels read a slot by."""
        return tuple((code, at) for code, _, _, at, _ in self.parts)

    @property
    def types(self) -> list[str]:
        return [qtype(code).name for code, *_ in self.parts]

    def views(self, block: torch.Tensor) -> tuple[QuantRows, QuantTensor]:
        """A block (≥ nbytes,) uint8 → (gate_up as QuantRows of gate and up, down): views, no copy."""
        gate, up, down = (QuantTensor(block[at:at + n].view(rows, n // rows), code, (rows, cols))
                          for code, rows, cols, at, n in self.parts)
        return QuantRows([gate, up]), down

    def dequantize(self, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks (n, ≥ nbytes) uint8 on any device → (n, P) fp32 [gate_up (2I·H) | down (H·I)], the
        slot layout. On the CPU through engine/quant's kernels; elsewhere with torch ops on the device."""
        n, out = blocks.shape[0], []
        for code, rows, cols, at, nbytes in self.parts:
            part = blocks[:, at:at + nbytes].reshape(n * rows, nbytes // rows)  # (n·rows, row bytes)
            if blocks.device.type == "cpu":
                values = QuantTensor(part.contiguous(), code, (n * rows, cols)).dequantize()
            else:
                values = dequantize_blocks_torch(part, code)
            out.append(values.reshape(n, rows * cols))
        return torch.cat(out, dim=1)


def _unregister(ptr: int, keepalive: torch.Tensor) -> None:
    """Unpin before the memory is freed (keepalive holds the buffer until this has run)."""
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))
    except Exception:  # interpreter shutdown: the driver may be gone already
        pass


class ExpertStore:
    def __init__(self, block_of: np.ndarray, n_blocks: int, hidden: int, expert_ffn: int, dtype: torch.dtype,
                 pin: bool = False, layouts: dict[int, QuantLayout] | None = None):
        """block_of: (n_layers, E) block index of each (layer, expert), −1 for layers without routed
        experts. Blocks are allocated here (uninitialised) and filled by `write`. layouts: per MoE
        layer, its quantised experts' layout (then blocks are bytes, and dtype is the slots' dtype)."""
        self.block_of = np.asarray(block_of, dtype=np.int64)  # (L, E)
        self.n_layers, self.n_experts = self.block_of.shape
        self.hidden, self.expert_ffn, self.dtype = hidden, expert_ffn, dtype
        self.layers = [l for l in range(self.n_layers) if (self.block_of[l] >= 0).any()]  # MoE layers
        self.layouts = layouts or {}
        self.quantised = bool(self.layouts)
        self.weights_per_expert = 3 * hidden * expert_ffn  # P: a slot's elements
        # P elements, or a quantised block's bytes (the longest layer's)
        self.block_numel = max(l.nbytes for l in self.layouts.values()) if self.quantised else self.weights_per_expert
        self._split = 2 * expert_ffn * hidden
        block_dtype = torch.uint8 if self.quantised else dtype
        self.blocks = large_host_tensor((n_blocks, self.block_numel), block_dtype)  # (n_blocks, P), host, huge pages
        # Views made once per block: the decode path asks for a dozen per layer step, ~5 µs each to make.
        self._block_views: dict[int, torch.Tensor] = {}
        self._expert_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._moe_rows: np.ndarray | None = None  # (L, E, 5) int64, see moe_table
        self._quant_rows: dict[int, np.ndarray] = {}  # layer → (E, 3) int64, see quant_addresses
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
        layers, E, H, I = _expert_layers(gate_up, down)
        block_of = np.full((len(gate_up), E), -1, dtype=np.int64)
        firsts: dict[tuple, int] = {}
        sources: list[tuple[int, int]] = []  # (layer, expert) whose weights fill each block
        for l in layers:
            gu, dn = gate_up[l], down[l]
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

    @classmethod
    def from_quant_layers(cls, gate_up: list[QuantStack | None], down: list[QuantStack | None], *,
                          dtype: torch.dtype, pin: bool = False) -> "ExpertStore":
        """Per layer a QuantStack (E, 2I, H) and (E, H, I) of quantised experts (None: a layer without
        routed experts) → a store of their bytes, copied out of the file's map once; `dtype` is what
        the GPU slots hold them in. Experts that are one object listed several times share a block."""
        layers, E, H, I = _expert_layers(gate_up, down)
        block_of = np.full((len(gate_up), E), -1, dtype=np.int64)
        layouts, sources, firsts = {}, [], {}
        for l in layers:
            gu, dn = gate_up[l], down[l]
            layouts[l] = QuantLayout.of_expert(gu.experts[0], dn.experts[0], H, I)
            for e in range(E):
                key = (id(gu.experts[e]), id(dn.experts[e]))
                if key not in firsts:
                    if _gate_up_types(gu.experts[e]) + (dn.experts[e].qtype.code,) != tuple(
                            code for code, *_ in layouts[l].parts):
                        raise ModelFileError(f"layer {l}: expert {e} is stored in other block types than expert 0",
                                             "the file is damaged: download or convert it again")
                    firsts[key] = len(sources)
                    sources.append((gu.experts[e], dn.experts[e], layouts[l]))
                block_of[l, e] = firsts[key]
        store = cls(block_of, len(sources), H, I, dtype, pin, layouts)
        for index, (gu, dn, layout) in enumerate(sources):
            block = store.blocks[index]
            parts = gu.parts if isinstance(gu, QuantRows) else [gu]
            for tensor, at in zip([*parts, dn], [0, *(layout.parts[1][3] for _ in parts[1:]), layout.parts[2][3]]):
                block[at:at + tensor.nbytes].copy_(tensor.blocks.reshape(-1))
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

    def expert(self, layer: int, expert: int) -> tuple:
        """Views (2I, H), (H, I) of the expert's block, for in-place CPU compute: tensors, or a quantised
        store's (QuantRows of gate and up, QuantTensor down) for engine/quant's products."""
        index = int(self.block_of[layer, expert])
        views = self._expert_views.get(index)
        if views is None:
            block = self.block(layer, expert)
            if self.quantised:
                views = self.layouts[layer].views(block)
            else:
                views = (block[:self._split].view(2 * self.expert_ffn, self.hidden),
                         block[self._split:].view(self.hidden, self.expert_ffn))
            self._expert_views[index] = views
        return views

    def quant_addresses(self, layer: int) -> np.ndarray:
        """A quantised store's (E, 3) int64 gate, up and down block addresses of the layer's experts
        (engine/quant/moe.py's table), made once a layer (the blocks never move)."""
        rows = self._quant_rows.get(layer)
        if rows is None:
            first = self.blocks.data_ptr() + self.block_of[layer] * self.block_bytes  # (E,)
            offsets = np.array([at for _, _, _, at, _ in self.layouts[layer].parts], dtype=np.int64)
            rows = self._quant_rows[layer] = first[:, None] + offsets  # (E, 3)
        return rows

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
        if self.quantised:
            raise ValueError("a quantised store's experts are computed through engine/quant, not the BF16 table")
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
    def slot_bytes(self) -> int:
        """Bytes of one expert in a GPU slot: its block (a quantised store's bytes are kept there)."""
        return self.block_bytes

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


def _gate_up_types(gate_up) -> tuple[int, int]:
    """An expert's gate and up block types: a QuantRows of the two, or one QuantTensor of both."""
    if isinstance(gate_up, QuantRows):
        if len(gate_up.parts) != 2:
            raise ModelFileError(f"{gate_up.name}: an expert's gate_up in {len(gate_up.parts)} parts",
                                 "the file is damaged: download or convert it again")
        return gate_up.parts[0].qtype.code, gate_up.parts[1].qtype.code
    return gate_up.qtype.code, gate_up.qtype.code


def _expert_layers(gate_up: list, down: list) -> tuple[list[int], int, int, int]:
    """The layers with routed experts and their (E, H, I), every layer's (E, 2I, H) and (E, H, I)
    stacks checked against the first's."""
    layers = [l for l, t in enumerate(gate_up) if t is not None]
    if not layers:
        raise ModelFileError("the model has no routed experts to store", "use expert_policy resident")
    E, two_i, H = gate_up[layers[0]].shape
    I = two_i // 2
    for l in layers:
        gu, dn = gate_up[l], down[l]
        if tuple(gu.shape) != (E, 2 * I, H) or dn is None or tuple(dn.shape) != (E, H, I):
            raise ModelFileError(f"layer {l}: expert tensors of shapes {tuple(gu.shape)} / "
                                 f"{None if dn is None else tuple(dn.shape)} do not match ({E}, {2 * I}, {H})",
                                 "the weights do not match the config")
    return layers, E, H, I
