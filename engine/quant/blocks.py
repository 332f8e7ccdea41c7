"""A GGUF tensor kept in its block format: `QuantTensor`.

The block bytes are a uint8 torch tensor (rows, row_bytes) that views the file's memory map (no copy:
pages are read from the file when first touched), with the ggml type and the logical shape
(rows, cols) of the fp32 matrix they encode. Row operations (select, concatenate) stay in blocks, since
every block belongs to one row. The 32-weight layouts (fp16 scale d first; q[i] = lo(qs[i]) for
i < 16, hi(qs[i − 16]) above, and for Q5 bit i of the little-endian u32 qh as q[i]'s fifth bit):

    Q4_0  18 bytes: d, 16 bytes of nibbles          w[i] = (q[i] − 8)·d
    Q4_1  20 bytes: d, m, 16 bytes of nibbles       w[i] = q[i]·d + m
    Q5_0  22 bytes: d, qh, 16 bytes of nibbles      w[i] = (q[i] − 16)·d
    Q5_1  24 bytes: d, m, qh, 16 bytes of nibbles   w[i] = q[i]·d + m
    Q8_0  34 bytes: d, 32 int8                      w[i] = qs[i]·d
    MXFP4 17 bytes: e (E8M0), 16 bytes of nibbles   w[i] = E2M1(q[i])·2^(e − 127)

(MXFP4, gpt-oss's experts: each nibble an E2M1 float, bit 3 its sign and bits 0–2 one of
0, 0.5, 1, 1.5, 2, 3, 4, 6; e a bare exponent byte. Read as doubled codes, integers up to ±12, times
2^(e − 128): every value exact in fp32, subnormals included), and the K-quants' 256-weight super-blocks Q4_K (144 bytes), Q5_K (176), Q6_K (210): kquants.py.

Dequantisation is here too (`dequantize_rows`: the native kernel where the extension has it, torch
ops otherwise), so that a QuantTensor turns itself into floats without the products (matmul.py) that
build on it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property

import torch

from engine.errors import ModelFileError
from engine.kernels import native
from engine.quant.kquants import QK_K, dequantize_kquant_torch

BLOCK = 32  # weights per block of the 32-weight types, and per sub-block of the K-quants


@dataclass(frozen=True)
class QType:
    name: str
    code: int  # ggml's number for it (GGUF's tensor type field; the native kernels take it)
    block_bytes: int
    block_weights: int = BLOCK  # 256 for the K-quants' super-blocks


QTYPES = {t.code: t for t in (QType("Q4_0", 2, 18), QType("Q4_1", 3, 20), QType("Q5_0", 6, 22),
                              QType("Q5_1", 7, 24), QType("Q8_0", 8, 34), QType("Q4_K", 12, 144, QK_K),
                              QType("Q5_K", 13, 176, QK_K), QType("Q6_K", 14, 210, QK_K),
                              QType("MXFP4", 39, 17))}
# MXFP4's E2M1 codes doubled (index = the nibble; 0 and 8 are both zero): ±{0, 1, 2, 3, 4, 6, 8, 12}
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def qtype(code: int) -> QType:
    if code not in QTYPES:
        names = ", ".join(t.name for t in QTYPES.values())
        raise ModelFileError(f"quantised block type {code} is not one Tandem keeps in blocks",
                             f"the kept types are {names}; others load dequantised")
    return QTYPES[code]


class QuantTensor:
    """Rows of quantised blocks: `blocks` uint8 (rows, cols/32 · block_bytes), logical shape (rows, cols)."""

    def __init__(self, blocks: torch.Tensor, type_code: int, shape: tuple[int, int], name: str = "?"):
        qt = qtype(type_code)
        rows, cols = (int(s) for s in shape)
        if cols % qt.block_weights:
            raise ModelFileError(f"tensor {name}: {cols} columns are not whole {qt.name} blocks of {qt.block_weights}",
                                 "the file is damaged: download or convert it again")
        row_bytes = cols // qt.block_weights * qt.block_bytes
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or tuple(blocks.shape) != (rows, row_bytes):
            raise ModelFileError(
                f"tensor {name}: its {qt.name} data is {tuple(blocks.shape)} {blocks.dtype}, a "
                f"{rows}×{cols} matrix needs ({rows}, {row_bytes}) bytes",
                "the file is truncated or damaged: download or copy it again")
        if blocks.stride(1) != 1 or blocks.stride(0) != row_bytes:
            blocks = blocks.contiguous()  # the kernels walk rows at row_bytes
        self.blocks, self.qtype, self.shape, self.name = blocks, qt, (rows, cols), name
        self.row_bytes = row_bytes

    @classmethod
    def from_gguf(cls, data, type_code: int, name: str) -> QuantTensor:
        """A GGUF reader tensor's data (numpy uint8 (rows, row_bytes), a view of the read-only map)."""
        import numpy as np

        qt = qtype(type_code)
        array = np.asarray(data)
        if array.dtype != np.uint8 or array.ndim != 2:
            raise ModelFileError(f"tensor {name}: {qt.name} data of shape {array.shape} {array.dtype}",
                                 "the file is damaged: download or convert it again")
        rows, row_bytes = array.shape
        if row_bytes % qt.block_bytes:
            raise ModelFileError(f"tensor {name}: rows of {row_bytes} bytes are not whole {qt.name} blocks",
                                 "the file is damaged: download or convert it again")
        with warnings.catch_warnings():  # the map is read-only and nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(array)
        return cls(blocks, type_code, (rows, row_bytes // qt.block_bytes * qt.block_weights), name)

    # -- what the loader and the placement code ask of a tensor --

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dim(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"QuantTensor({self.name}, {self.qtype.name}, {self.shape})"

    @cached_property
    def native_parts(self):
        """numpy int64 (1, 4): (block address, type, rows, row bytes), the native product's description."""
        import numpy as np

        return np.array([[self.blocks.data_ptr(), self.qtype.code, self.shape[0], self.row_bytes]], dtype=np.int64)

    def __getitem__(self, rows) -> QuantTensor:
        """Rows by index tensor, list or slice: a QuantTensor of them (a copy unless a slice)."""
        if isinstance(rows, slice):
            picked = self.blocks[rows]
        else:
            picked = self.blocks.index_select(0, torch.as_tensor(rows, dtype=torch.long))
        return QuantTensor(picked, self.qtype.code, (picked.shape[0], self.shape[1]), self.name)

    @staticmethod
    def cat_rows(parts: list[QuantTensor], name: str = "?") -> QuantTensor:
        """The rows of `parts` one after another (one type, one width): a copy of the blocks."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError(f"{name}: cannot stack rows of different types or widths")
        blocks = torch.cat([p.blocks for p in parts])
        return QuantTensor(blocks, first.qtype.code, (blocks.shape[0], first.shape[1]), name)

    def to(self, device: torch.device) -> QuantTensor:
        """The same blocks on `device` (a copy unless they are there already)."""
        return QuantTensor(self.blocks.to(device), self.qtype.code, self.shape, self.name)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (rows, cols) matrix in `dtype`."""
        return dequantize_rows(self).to(dtype)

    @staticmethod
    def stacked(tensors: list[QuantTensor], name: str) -> QuantTensor:
        """Matrices of one type and width as one, their rows one after another (a copy of the blocks:
        its parts_of views then stand in for them)."""
        if len({(t.qtype.code, t.shape[1], t.blocks.device) for t in tensors}) != 1:
            raise ValueError(f"{name}: only matrices of one type, width and device stack")
        return QuantTensor(torch.cat([t.blocks for t in tensors]), tensors[0].qtype.code,
                           (sum(t.shape[0] for t in tensors), tensors[0].shape[1]), name)

    def parts_of(self, rows: list[int]) -> list[QuantTensor]:
        """Views of consecutive row ranges, `rows` long each."""
        firsts = [0]
        for n in rows:
            firsts.append(firsts[-1] + n)
        return [self[a:b] for a, b in zip(firsts, firsts[1:])]


class QuantRows:
    """Rows of several QuantTensors one after another, (Σ rows, cols), without a copy: an expert's
    gate_up (2I, H) as its gate (I, H) and up (I, H) rows where the file stores them apart (GGUF's
    `ffn_gate_exps` and `ffn_up_exps`). The parts may differ in type; products run part by part."""

    def __init__(self, parts: list[QuantTensor], name: str = "?"):
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"{name}: rows of different widths cannot be joined")
        self.parts, self.name = list(parts), name
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dim(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"QuantRows({self.name}, {' + '.join(f'{p.qtype.name} {p.shape}' for p in self.parts)})"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    @cached_property
    def native_parts(self):
        """numpy int64 (P, 4): each part's row of QuantTensor.native_parts, in order."""
        import numpy as np

        return np.concatenate([p.native_parts for p in self.parts])


class QuantStack:
    """A layer's routed experts as quantised matrices: `experts[e]` (N, K) for e < E; shape (E, N, K).
    Each expert is a QuantTensor or a QuantRows. Copies of one expert (the upcycled built-in MoE) are
    one object listed E times."""

    def __init__(self, experts: list[QuantTensor | QuantRows]):
        shapes = {e.shape for e in experts}
        if len(shapes) != 1:
            raise ValueError(f"experts of one stack differ in shape: {sorted(shapes)}")
        self.experts = experts
        self.shape = (len(experts), *experts[0].shape)

    @classmethod
    def from_gguf(cls, data, type_code: int, name: str) -> QuantStack:
        """A GGUF reader's stacked expert tensor (numpy uint8 (E, N, row_bytes), a view of the read-only
        map): expert e is rows [e·N, (e+1)·N) of the blocks, a QuantTensor viewing them (no copy)."""
        import numpy as np

        array = np.asarray(data)
        if array.dtype != np.uint8 or array.ndim != 3:
            raise ModelFileError(f"tensor {name}: stacked {qtype(type_code).name} data of shape "
                                 f"{array.shape} {array.dtype}", "the file is damaged: download or convert it again")
        E, N, row_bytes = array.shape
        whole = QuantTensor.from_gguf(array.reshape(E * N, row_bytes), type_code, name)  # (E·N, row_bytes) view
        return cls([whole[e * N:(e + 1) * N] for e in range(E)])

    @staticmethod
    def cat_rows(first: QuantStack, second: QuantStack, name: str = "?") -> QuantStack:
        """Expert by expert, the rows of `first` then those of `second`, as QuantRows (no copy): GGUF's
        gate and up stacks (E, I, H) each → gate_up (E, 2I, H), gate rows first."""
        if first.shape[0] != second.shape[0]:
            raise ValueError(f"{name}: stacks of {first.shape[0]} and {second.shape[0]} experts cannot be joined")
        return QuantStack([QuantRows([a, b], name) for a, b in zip(first.experts, second.experts)])

    def dim(self) -> int:
        return 3

    @property
    def nbytes(self) -> int:
        return sum({id(e): e.nbytes for e in self.experts}.values())  # shared copies once

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        unique = {id(e): e.dequantize(dtype) for e in self.experts}
        return torch.stack([unique[id(e)] for e in self.experts])  # (E, N, K)

    def types(self) -> list[str]:
        """The block types its experts are stored in, in order of first use."""
        names: dict[str, None] = {}
        for e in self.experts:
            for p in getattr(e, "parts", (e,)):
                names[p.qtype.name] = None
        return list(names)


def dequantize_blocks_torch(blocks: torch.Tensor, type_code: int) -> torch.Tensor:
    """Block bytes (rows, row_bytes) → fp32 (rows, cols) with torch ops alone, on the blocks' device: the
    fallback when the native extension is absent, and the dequantisation of expert fills on a GPU. Each
    value is gguf's: q·d is exact in fp32, so only "+ m" rounds."""
    qt = qtype(type_code)
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, qt.block_bytes)  # (rows, blocks, bytes)
    if qt.block_weights != BLOCK:
        return dequantize_kquant_torch(b, qt.name).reshape(rows, -1)
    if qt.name == "MXFP4":
        return _dequantize_mxfp4(b).reshape(rows, -1)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # (rows, cols/32, 1)
    if qt.name == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()  # (rows, cols/32, 32)
        return (q * d).reshape(rows, -1)
    has_m = qt.name in ("Q4_1", "Q5_1")
    qs = b[..., -16:]  # (rows, cols/32, 16): the nibbles are every type's last 16 bytes
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).int()  # (rows, cols/32, 32): low nibbles first
    if qt.name in ("Q5_0", "Q5_1"):
        at = 4 if has_m else 2
        qh = b[..., at:at + 4].contiguous().view(torch.int32)  # (rows, cols/32, 1), little-endian
        q |= ((qh >> torch.arange(32, dtype=torch.int32, device=b.device)) & 1) << 4  # bit i: weight i's fifth bit
    if has_m:
        m = b[..., 2:4].contiguous().view(torch.float16).float()
    else:  # (q − 8)·d or (q − 16)·d as q·d + m: both terms exact, so the sum is too
        m = -(8.0 if qt.name == "Q4_0" else 16.0) * d
    return (q.float() * d + m).reshape(rows, -1)


def _dequantize_mxfp4(b: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks (rows, n, 17) → fp32 (rows, n, 32). The halved scale 2^(e − 128) is built from its
    bits: the float with biased exponent e − 1 for e ≥ 2; e = 0, 1 are the subnormals 2^-128, 2^-127."""
    e = b[..., 0:1].int()  # (rows, n, 1)
    bits = torch.where(e >= 2, (e - 1) << 23, 0x00200000 << e)
    scale = bits.view(torch.float32)
    qs = b[..., 1:].long()  # (rows, n, 16)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # (rows, n, 32): low nibbles first
    q = torch.tensor(E2M1_DOUBLED, dtype=torch.float32, device=b.device)[codes]
    return q * scale  # exact: a small integer times a power of two (±inf past fp32's range, as gguf)


def native_quant():
    """The native extension where it has the quantised kernels, else None (the torch paths). One
    function for every caller, so that hiding it (the tests' torch runs) hides it everywhere."""
    nat = native.module()  # cached: the import is looked up once
    return nat if nat is not None and hasattr(nat, "quant_matmul") else None


def dequantize_rows(w: QuantTensor, rows: torch.Tensor | None = None, row_range: tuple[int, int] | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of W in fp32 or bf16 (which the native kernel writes itself, rounded to nearest even): all
    of them, the index tensor `rows` (int64, 1-D), or rows [a, b)."""
    n_rows, cols = w.shape
    nat = native_quant()
    if nat is None:
        if rows is not None:
            return dequantize_blocks_torch(w.blocks.index_select(0, rows.long()), w.qtype.code).to(dtype)
        a, b = row_range or (0, n_rows)
        return dequantize_blocks_torch(w.blocks[a:b], w.qtype.code).to(dtype)
    row_bytes, bf16 = w.blocks.shape[1], dtype == torch.bfloat16
    made = torch.bfloat16 if bf16 else torch.float32  # what the kernel writes; other dtypes convert after
    if rows is not None:
        ids = rows.reshape(-1).to(torch.int64).contiguous().numpy()
        out = torch.empty(ids.shape[0], cols, dtype=made)
        nat.quant_dequantize(w.blocks.data_ptr(), w.qtype.code, cols, row_bytes, n_rows, 0, 0, ids,
                             out.data_ptr(), cols, native.threads(), bf16)
        return out.to(dtype)
    a, b = row_range or (0, n_rows)
    out = torch.empty(b - a, cols, dtype=made)
    nat.quant_dequantize(w.blocks.data_ptr(), w.qtype.code, cols, row_bytes, n_rows, a, b, None,
                         out.data_ptr(), cols, native.threads(), bf16)
    return out.to(dtype)
