"""Model files on disk, read without loading them: a GGUF file's header, a Hugging Face folder's config.

Two uses. `inspect_model(path)` says what a file or folder is (name, architecture, size, quantisation,
context length) and raises ModelFileError when it is damaged — a truncated download, a file that is
not GGUF, a folder whose shards are missing — so a switch to it can be refused while the working
model stays loaded. `find_models()` (app/model_scan.py) lists what is already on this computer.

Only headers are read (a GGUF header is a few MB at most, mostly the tokenizer's vocabulary; a
safetensors header a few KB): never the weights, never torch.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types (gguf spec): id → struct format (None: variable length).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# ggml tensor types → (bytes per block, elements per block), for the size check of a GGUF's data.
GGML_BLOCK = {0: (4, 1), 1: (2, 1), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32), 9: (36, 32),
              10: (84, 256), 11: (110, 256), 12: (144, 256), 13: (176, 256), 14: (210, 256), 15: (292, 256),
              16: (66, 256), 17: (74, 256), 18: (98, 256), 19: (50, 256), 20: (18, 32), 21: (110, 256),
              22: (82, 256), 23: (136, 256), 24: (1, 1), 25: (2, 1), 26: (4, 1), 27: (8, 1), 28: (8, 1),
              29: (56, 256), 30: (2, 1), 34: (54, 256), 35: (66, 256), 39: (17, 32)}

# general.file_type (llama.cpp's LLAMA_FTYPE) → the quantisation name people know.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
              18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
              25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
              32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4"}
TENSOR_TYPES = {0: "F32", 1: "F16", 8: "Q8_0", 30: "BF16"}  # a file without general.file_type: its first tensor's

SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")  # llama.cpp's split files: name-00001-of-00003.gguf


class ModelFileError(Exception):
    """A model file or folder that cannot be used: what is wrong with it and what to do."""

    def __init__(self, what: str, remedy: str):
        self.what, self.remedy = what, remedy
        super().__init__(f"{what} — {remedy}")


@dataclass
class ModelInfo:
    path: Path
    kind: str  # "gguf" | "hf"
    name: str
    size_bytes: int
    quant: str | None = None  # Q4_K_M, BF16, …
    context_length: int | None = None
    architecture: str | None = None
    mtime: float = 0.0
    source: str = ""  # where it was found (set by the scan)
    parts: list[Path] = field(default_factory=list)  # every file of a split GGUF
    params: int | None = None  # weights, counted from the tensor shapes in the headers
    active_params: int | None = None  # a mixture of experts: the weights one token uses (top-k of the experts)


class _Reader:
    def __init__(self, f, path: Path, size: int):
        self.f, self.path, self.size = f, path, size

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ModelFileError(f"{self.path.name} ends inside its header ({self.size:,} bytes): the file is "
                                 "truncated or damaged", "download it again (its download may not have finished)")
        return data

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > self.size:
            raise ModelFileError(f"{self.path.name} has a corrupt header (a string of {n:,} bytes)",
                                 "download the file again")
        return self.read(n).decode("utf-8", errors="replace")

    def value(self, kind: int, keep: bool):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS and not keep:  # skip a long numeric array (token scores, types) in one seek
                width = struct.calcsize(_SCALARS[item])
                if self.f.tell() + width * count > self.size:
                    self.read(self.size)  # raises: the array runs past the end
                self.f.seek(width * count, os.SEEK_CUR)
                return None
            values = [self.value(item, keep) for _ in range(count)]
            return values if keep else None
        raise ModelFileError(f"{self.path.name} has a corrupt header (unknown value type {kind})",
                             "download the file again; if it persists, the file needs a newer llama.cpp format")


def read_gguf_header(path: str | Path) -> tuple[dict, list[tuple[str, int, int, int]], int]:
    """(metadata without arrays, tensors as (name, ggml type, elements, offset), data start), checked
    against the file's size so that a truncated file is found here and not half-way through a load."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, path, size)
        if f.read(4) != GGUF_MAGIC:
            raise ModelFileError(f"{path.name} is not a GGUF file (it does not start with 'GGUF')",
                                 "choose a .gguf model file, or a Hugging Face model folder")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise ModelFileError(f"{path.name} is GGUF version {version}; versions 2 and 3 are supported",
                                 "convert it again with a current llama.cpp")
        n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise ModelFileError(f"{path.name} has a corrupt header ({n_tensors:,} tensors, {n_kv:,} keys)",
                                 "download the file again")
        meta: dict = {}
        for _ in range(n_kv):
            key, kind = r.string(), r.unpack("<I")
            v = r.value(kind, keep=False)
            if v is not None:
                meta[key] = v
        tensors = []
        for _ in range(n_tensors):
            name, dims = r.string(), r.unpack("<I")
            if dims > 8:
                raise ModelFileError(f"{path.name} has a corrupt tensor table ({name}: {dims} dimensions)",
                                     "download the file again")
            elements = 1
            for _ in range(dims):
                elements *= r.unpack("<Q")
            tensors.append((name, r.unpack("<I"), elements, r.unpack("<Q")))
        align = int(meta.get("general.alignment", 32)) or 32
        start = -(-f.tell() // align) * align
    end = start
    for name, kind, elements, offset in tensors:
        block = GGML_BLOCK.get(kind)
        if block is not None:
            end = max(end, start + offset + elements // block[1] * block[0])
    if end > size:
        raise ModelFileError(f"{path.name} is truncated: its tensors need {end:,} bytes, the file has {size:,}",
                             "download it again (its download may not have finished)")
    return meta, tensors, start


def inspect_gguf(path: str | Path) -> ModelInfo:
    path = Path(path)
    meta, tensors, _ = read_gguf_header(path)
    parts = [path]
    m = SHARD.search(path.name)
    if m:  # the first of a split model: the others sit next to it
        total = int(m.group(2))
        parts = [path.with_name(SHARD.sub(f"-{i:05d}-of-{total:05d}.gguf", path.name)) for i in range(1, total + 1)]
        missing = [p.name for p in parts if not p.is_file()]
        if missing:
            raise ModelFileError(f"{path.name} is part 1 of {total}; missing: {', '.join(missing)}",
                                 "download every part into the same folder")
    arch = meta.get("general.architecture")
    ftype = meta.get("general.file_type")
    quant = FILE_TYPES.get(ftype) if ftype is not None else None
    if quant is None and tensors:
        quant = TENSOR_TYPES.get(tensors[0][1])
    ctx = meta.get(f"{arch}.context_length") if arch else None
    name = meta.get("general.name") or path.stem
    st = path.stat()
    params, active = None, None
    if len(parts) == 1:  # a split file's other parts hold tensors whose headers are not read here
        # llama.cpp names the routed experts' stacked tensors *_exps (shared experts: *_shexp)
        params = sum(t[2] for t in tensors)
        active = _active(params, sum(t[2] for t in tensors if "_exps" in t[0]),
                         meta.get(f"{arch}.expert_count"), meta.get(f"{arch}.expert_used_count"))
    return ModelInfo(path, "gguf", str(name), sum(p.stat().st_size for p in parts), quant,
                     int(ctx) if ctx else None, arch, st.st_mtime, parts=parts, params=params, active_params=active)


def _active(total: int, routed: int, experts, used) -> int | None:
    """The weights one token runs through: all but the routed experts, and `used` of `experts` of those."""
    if not routed or not experts or not used or used >= experts:
        return None
    return total - routed + routed * int(used) // int(experts)


def _safetensors_end(path: Path) -> tuple[int, int, set[str], dict[str, int]]:
    """(bytes the header says the file holds, bytes it has, dtypes, elements of each tensor) of one
    safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ModelFileError(f"{path.name} is empty or truncated", "download the model folder again")
        n = struct.unpack("<Q", head)[0]
        if n > min(size, 100 * 2**20):
            raise ModelFileError(f"{path.name} is not a safetensors file (header of {n:,} bytes)",
                                 "download the model folder again")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ModelFileError(f"{path.name} has a damaged header ({e})", "download the model folder again") from e
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    dtypes = {v.get("dtype") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    elements = {k: _product(v.get("shape") or []) * _per_element(k, v.get("dtype")) for k, v in header.items()
                if k != "__metadata__" and isinstance(v, dict)}
    return 8 + n + max(ends, default=0), size, {d for d in dtypes if d}, elements


def _per_element(name: str, dtype: str | None) -> int:
    """Weights per stored element: MXFP4 (gpt-oss's own release) packs two 4-bit weights in each byte of
    its `*_blocks` tensors; its `*_scales` are not weights (one exponent per 32 of them)."""
    if name.endswith("_scales") and dtype == "U8":
        return 0
    return 2 if name.endswith("_blocks") and dtype == "U8" else 1


def _product(shape: list) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def inspect_folder(path: str | Path) -> ModelInfo:
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelFileError(f"{path} has no config.json, so it is not a Hugging Face model folder",
                             "choose the folder that holds config.json and the *.safetensors files, or a .gguf file")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{cfg_path} cannot be read ({e})", "download the model folder again") from e
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise ModelFileError(f"{index.name} cannot be read ({e})", "download the model folder again") from e
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{path} has no *.safetensors weights", "download the weights into the folder")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelFileError(f"{path.name} is missing {len(missing)} of {len(files)} weight files "
                             f"({', '.join(missing[:3])}{'…' if len(missing) > 3 else ''})",
                             "finish the download (every file listed in model.safetensors.index.json)")
    dtypes: set[str] = set()
    elements: dict[str, int] = {}
    for f in files:
        need, have, kinds, counts = _safetensors_end(f)
        if have < need:
            raise ModelFileError(f"{f.name} is truncated: its header needs {need:,} bytes, the file has {have:,}",
                                 "download it again (its download may not have finished)")
        dtypes |= kinds
        elements |= counts
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    quant = None
    q = cfg.get("quantization_config")
    if isinstance(q, dict):
        quant = str(q.get("quant_method") or q.get("quant_type") or "quantised")
        if q.get("bits"):
            quant += f" {q['bits']}-bit"
    elif dtypes:
        quant = "/".join(sorted(d for d in dtypes if d not in ("I64", "I32", "BOOL"))) or None
    ctx = text.get("max_position_embeddings") or cfg.get("max_position_embeddings")
    arch = text.get("model_type") or cfg.get("model_type")
    mtime = max(f.stat().st_mtime for f in files)
    params = sum(elements.values())
    # routed experts: `….experts.…` (Mixtral: block_sparse_moe.experts), never the shared ones
    routed = sum(n for k, n in elements.items() if ".experts." in k and "shared_expert" not in k)
    experts = next((text.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts") if text.get(k)), None)
    active = _active(params, routed, experts, text.get("num_experts_per_tok"))
    return ModelInfo(path, "hf", path.name, sum(f.stat().st_size for f in files), quant,
                     int(ctx) if ctx else None, arch, mtime, parts=files, params=params or None, active_params=active)


def inspect_model(path: str | Path) -> ModelInfo:
    """What the file or folder at `path` is; ModelFileError (what, remedy) when it cannot be used."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(f"{p} does not exist", "check the path, or choose the model again")
    try:
        return inspect_folder(p) if p.is_dir() else inspect_gguf(p)
    except OSError as e:
        raise ModelFileError(f"{p} cannot be read ({e.strerror or e})", "check the file's permissions") from e


def is_model_path(model: str | None) -> bool:
    """A model given as a file or folder (not builtin:…, synthetic:… or a remote id)."""
    return bool(model) and not model.startswith(("builtin:", "synthetic:"))
