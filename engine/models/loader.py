"""Reading model files: GGUF (through the `gguf` package) and Hugging Face folders
(config.json + safetensors, memory-mapped, never pickle).

GGUF weights are dequantised to the engine dtype, except with `quantised=True` (the CPU plan of
dtype "auto", whose experts are all resident on the CPU): then dense matrices of the types engine/quant
computes over (`QTYPES`: Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4) stay in their blocks as
`QuantTensor`s that view the file's map, and so do the stacked routed experts (`*_exps`) of the
families in `EXPERT_BLOCK_FAMILIES`, as `QuantStack`s of per-expert row views; every other quantised
type is dequantised with a one-line warning that says what it costs.

Both come out as a `Checkpoint`: an HF-style config dict and tensors under HF names, after the
family's `sanitize` step. Every failure names the file and says what to do.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import ModelFileError, UnsupportedModelError
from engine.models import families
from engine.quant.blocks import QTYPES, QuantStack, QuantTensor

log = logging.getLogger("tandem.loader")


@dataclass
class Checkpoint:
    path: Path  # the .gguf file or the model folder
    family: str  # key of engine.models.families.FAMILIES
    config: dict  # HF-style config.json contents
    tensors: dict[str, torch.Tensor] = field(repr=False)  # HF names, engine dtype; on the host (synthetic: placed)
    tokenizer_dir: Path | None = None  # folder to load the tokenizer from (None: no tokenizer)
    gguf_file: str | None = None  # file name inside tokenizer_dir when the tokenizer is in a GGUF


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype = torch.float32, quantised: bool = False,
                    expert_blocks: bool = False) -> Checkpoint:
    """quantised: keep a GGUF's dense matrices and routed experts of engine/quant's types in blocks
    (module docstring); expert_blocks: the routed experts alone (an offloading plan's host store)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFileError(f"model not found: {path}",
                             "check the path, or run `tandem models` to list the built-in models")
    if path.is_dir():
        return _load_folder(path, dtype)
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path, dtype, quantised, expert_blocks)
    raise ModelFileError(f"{path} is neither a .gguf file nor a model folder",
                         "pass a .gguf file or a folder holding config.json and *.safetensors")


# -- GGUF ------------------------------------------------------------------------------------------

# Families whose stacked routed experts stay in blocks under `quantised`: their GGUF names go through
# gguf_names.sanitize_moe_gguf, which joins gate and up stacks without a copy, and their experts are
# what engine/quant/experts.py computes: plain SwiGLU (gate, up, down), or gpt-oss's biased, clamped
# form (its biases are float tensors beside the blocks; the executor takes them through `set_form`).
# qwen3_5_moe's, glm4_moe's and deepseek_v2's own mappings take their experts as they come too (split
# stacks through sanitize_moe_gguf, or Qwen3.5's fused `ffn_gate_up_exps`, gate rows first: the engine's
# gate_up as it is). Mixtral's early per-expert tensors (`ffn_gate.{e}`) are stacked by torch and so
# dequantised even here; its stacked `*_exps` stay blocks.
EXPERT_BLOCK_FAMILIES = frozenset({"qwen3_moe", "olmoe", "mixtral", "gpt_oss", "qwen3_5_moe", "glm4_moe",
                                   "deepseek_v2"})


def keeps_expert_blocks(family: str, quantised: bool) -> bool:
    """Whether a GGUF's stacked routed experts load as `QuantStack`s. `quantised` is a plan that keeps
    them (runtime/loading, dtype auto): the CPU plan, where every expert runs in place on the CPU, and
    the offloading policies, whose host store keeps the blocks; experts resident on a GPU dequantise."""
    return quantised and family in EXPERT_BLOCK_FAMILIES


def _keeps_blocks(name: str, shape) -> bool:
    """Dense matrices the CPU layers compute over in blocks: not routed experts (stacked `*_exps`:
    `_keeps_stacked_experts` decides those; early Mixtral's `ffn_gate.{e}` load float), not routers."""
    parts = name.split(".")
    single_expert = len(parts) == 5 and parts[3].isdigit()
    return len(shape) == 2 and "_exps" not in name and "ffn_gate_inp" not in name and not single_expert


def matrices_in_blocks(path: str | os.PathLike) -> bool:
    """Whether every matrix a CPU load of this GGUF keeps in blocks is of a type the quantised kernels
    compute over (QTYPES), so that no layer, nor a tied head, runs dequantised to float. From the header."""
    matrices = [t for t in gguf_reader(path).tensors if _keeps_blocks(t.name, t.shape)]
    return bool(matrices) and all(int(t.tensor_type) in QTYPES for t in matrices)


def _keeps_stacked_experts(name: str, shape) -> bool:
    """A layer's stacked routed expert weight, `blk.N.ffn_{gate,up,down,gate_up}_exps.weight` (E, N, K) (not
    its biases)."""
    parts = name.split(".")
    return (len(shape) == 3 and len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight"
            and parts[2] in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"))


# Metadata arrays under this prefix (the vocabulary: tokens, scores, token types, merges) are stepped
# over, not decoded: gguf's reader builds two numpy views per array item, ~9 s for SmolLM2's 49152
# tokens and 48900 merges on the 2-core machine and ~3x that for a 151936-token Qwen3 vocabulary, per
# reader; loading read the header twice (the plan's shape, then the weights), 30 s of a 33 s load of
# the 0.1 GB built-in file. The tokenizer reads them itself (runtime/chat.py).
SKIPPED_ARRAYS = "tokenizer.ggml."


def gguf_reader(path: str | os.PathLike):
    """A `gguf.GGUFReader` of `path` whose `SKIPPED_ARRAYS` fields are present but empty (their
    contents() is []): every other field and every tensor as the plain reader gives them. The fast
    reader overrides the reader's private field loop; where a gguf release changed it, gguf's own
    reader reads the file instead."""
    import gguf

    try:
        return _fast_reader(path)
    except Exception:  # a gguf whose reader's internals differ (or a damaged file): the plain reader
        # decides, slower but with its own errors for a file that is really damaged
        log.debug("the fast GGUF header read failed; reading %s with gguf's own reader", path, exc_info=True)
        return gguf.GGUFReader(path)


def _fast_reader(path: str | os.PathLike):
    import struct

    import gguf
    import numpy as np

    class MetaReader(gguf.GGUFReader):
        def _build_fields(self, offs: int, count: int) -> int:
            # the base class's loop, with the skipped arrays stepped over
            for _ in range(count):
                orig_offs = offs
                klen, kdata = self._get_str(offs)
                offs += int(klen.nbytes + kdata.nbytes)
                raw_type = self._get(offs, np.uint32)
                offs += int(raw_type.nbytes)
                name = str(bytes(kdata), encoding="utf-8")
                skip = (raw_type[0] == gguf.GGUFValueType.ARRAY and name.startswith(SKIPPED_ARRAYS)
                        and self.byte_order != "S")
                size, parts, idxs, types = (self._step_over_array(offs) if skip
                                            else self._get_field_parts(offs, raw_type[0]))
                self._push_field(gguf.ReaderField(orig_offs, name, [klen, kdata, raw_type, *parts],
                                                  [i + 3 for i in idxs], types), skip_sum=True)
                offs += size
            return offs

        def _step_over_array(self, offs: int):
            """(bytes, parts, data indices, types) of an array field, its items not decoded."""
            itype, alen = self._get(offs, np.uint32), self._get(offs + 4, np.uint64)
            n, sub = int(alen[0]), gguf.GGUFValueType(int(itype[0]))
            end = offs + 12
            if sub == gguf.GGUFValueType.STRING:
                buf, unpack = memoryview(self.data), struct.Struct("<Q").unpack_from
                for _ in range(n):  # each item: a uint64 length, then its bytes
                    end += 8 + unpack(buf, end)[0]
            elif sub in self.gguf_scalar_to_np:
                end += n * np.dtype(self.gguf_scalar_to_np[sub]).itemsize
            else:  # nested arrays: no vocabulary is one; decode as the base class does
                return self._get_field_parts(offs, gguf.GGUFValueType.ARRAY)
            return end - offs, [itype, alen], [], [gguf.GGUFValueType.ARRAY, sub]

    return MetaReader(path)


def held_bytes(path: str | os.PathLike, family: str, dtype_bytes: int) -> dict[str, int]:
    """Bytes a `quantised` load of this GGUF holds, by part ("embed", "output", "experts", "dense": the
    rest), from its header alone: the tensors `_load_gguf` keeps in blocks at their size in the file
    (views of its map), every other one dequantised at `dtype_bytes` a weight. What the placement
    planner sizes the CPU plan by: counted as float the 3.2 GB Q4_K_M file of
    synthetic:qwen3-30b-a3b-L8 was 19.3 GiB, and the plan refused to load it on a 24 GiB machine."""
    expert_blocks = keeps_expert_blocks(family, True)
    out = dict.fromkeys(("embed", "output", "experts", "dense"), 0)
    for t in gguf_reader(path).tensors:
        in_blocks = int(t.tensor_type) in QTYPES and (
            _keeps_blocks(t.name, t.shape) or (expert_blocks and _keeps_stacked_experts(t.name, t.shape)))
        part = ("embed" if t.name == "token_embd.weight" else "output" if t.name == "output.weight"
                else "experts" if "_exps" in t.name else "dense")
        out[part] += int(t.n_bytes) if in_blocks else int(t.n_elements) * dtype_bytes
    return out


def _load_gguf(path: Path, dtype: torch.dtype, quantised: bool = False, expert_blocks: bool = False) -> Checkpoint:
    import gguf
    from gguf.quants import dequantize

    try:
        reader = gguf_reader(path)
    except Exception as e:  # the reader fails in many ways on a cut or damaged file
        raise ModelFileError(f"{path} could not be read as GGUF ({type(e).__name__}: {e})",
                             "the file is truncated or corrupt: download or copy it again") from e
    size = path.stat().st_size
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise ModelFileError(f"{path} is truncated: {size} bytes, its tensors need {end}",
                             "download or copy the file again")

    meta = {}
    for key, fld in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.bos_token_id" and not key.endswith("_id"):
            continue  # vocabularies are large and the tokenizer reads them itself
        try:
            meta[key] = fld.contents()
        except Exception:  # a field type this gguf version cannot decode: not one we use
            continue
    family = families.for_gguf_meta(meta, path)
    config = family.config_from_gguf(meta)
    expert_blocks = keeps_expert_blocks(family.NAME, quantised or expert_blocks)

    supported = set(gguf.quants._type_traits) | {gguf.GGMLQuantizationType.F32,
                                                 gguf.GGMLQuantizationType.F16,
                                                 gguf.GGMLQuantizationType.BF16}
    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    raw = {}
    dequantised: dict[str, list[int]] = {}  # quant type → [tensors, file bytes] loaded dequantised
    views: list[tuple[int, int]] = []  # (file offset, bytes) of the tensors kept as views of the map
    for t in reader.tensors:
        if t.tensor_type not in supported:
            raise UnsupportedModelError(
                f"{path}: tensor {t.name} uses quant type {t.tensor_type.name}, which Tandem cannot dequantise",
                "use a GGUF with a common quant type (F16, BF16, Q8_0, Q4_0/1, Q5_0/1, K-quants)")
        if quantised and int(t.tensor_type) in QTYPES and _keeps_blocks(t.name, t.shape):
            raw[t.name] = QuantTensor.from_gguf(t.data, int(t.tensor_type), t.name)  # a view of the map
            views.append((int(t.data_offset), int(t.n_bytes)))
            continue
        if expert_blocks and int(t.tensor_type) in QTYPES and _keeps_stacked_experts(t.name, t.shape):
            raw[t.name] = QuantStack.from_gguf(t.data, int(t.tensor_type), t.name)  # row views of the map
            views.append((int(t.data_offset), int(t.n_bytes)))
            continue
        if quantised and t.tensor_type not in plain:
            counts = dequantised.setdefault(t.tensor_type.name, [0, 0, 0])
            counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + int(t.n_bytes), counts[2] + int(t.n_elements)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            raw[t.name] = _bf16_tensor(t.data).to(dtype)
            continue
        if int(t.tensor_type) in QTYPES:
            raw[t.name] = _dequantized(t, dtype)
            continue
        array = dequantize(t.data, t.tensor_type)  # float32, torch (out, in) order
        if not array.flags.writeable:  # F32/F16 tensors come back as views of the read-only map
            array = array.copy()
        raw[t.name] = torch.from_numpy(array).to(dtype)
    _experts_all_blocks_or_none(raw, dtype)
    populate_map(reader, views)
    if dequantised:
        item = torch.empty((), dtype=dtype).element_size()
        log.warning("%s: %s dequantised to %s at load (%.0f MB in the file, %.0f MB in memory): the CPU kernels "
                    "read %s blocks of dense matrices, and of routed experts in %s files, only so far", path.name,
                    ", ".join(f"{n} tensors of {name}" for name, (n, _, _) in sorted(dequantised.items())),
                    str(dtype).removeprefix("torch."), sum(b for _, b, _ in dequantised.values()) / 1e6,
                    sum(e for _, _, e in dequantised.values()) * item / 1e6,
                    ", ".join(t.name for t in QTYPES.values()), "/".join(sorted(EXPERT_BLOCK_FAMILIES)))
    tensors = _sanitize(family.sanitize_gguf, raw, config, path)
    if "tokenizer.ggml.model" not in reader.fields:  # weights only: usable through token ids
        return Checkpoint(path, family.NAME, config, tensors)
    return Checkpoint(path, family.NAME, config, tensors, tokenizer_dir=path.parent, gguf_file=path.name)


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; Python names it from 3.13


def populate_map(reader, spans: list[tuple[int, int]]) -> None:
    """Map the pages under `spans` (file offset, bytes) now, at load, as llama.cpp's loader does
    (MAP_POPULATE). Blocks kept as views of the map are otherwise paged in by the first decode steps
    that route to them: a fault per 16 pages, and where the file is not in the page cache a random
    read from disk (on the 2-core machine, 1.46 GB of experts read through first faults at 2.9 GB/s,
    17.5 GB/s with the file cached, 27 GB/s once mapped). One madvise call where the kernel has it;
    else one byte read a page, which faults each in."""
    if not spans:
        return
    lo = min(o for o, _ in spans)
    lo -= lo % mmap.PAGESIZE
    hi = max(o + n for o, n in spans)
    try:
        reader.data._mmap.madvise(MADV_POPULATE_READ, lo, hi - lo)
    except (AttributeError, OSError, ValueError):  # no such advice (older kernel, not Linux), or no mmap
        import numpy as np

        np.asarray(reader.data)[lo:hi:mmap.PAGESIZE].max()


def _experts_all_blocks_or_none(raw: dict, dtype: torch.dtype) -> None:
    """One executor runs every layer's experts, over blocks or over float tensors: where any stacked
    expert tensor came out float (a type outside QTYPES, or F16), the ones kept in blocks are
    dequantised too (in place in `raw`)."""
    stacked = [n for n in raw if _keeps_stacked_experts(n, getattr(raw[n], "shape", ()))]
    kept = [n for n in stacked if isinstance(raw[n], QuantStack)]
    if kept and len(kept) < len(stacked):
        log.warning("routed experts of mixed kinds (%d of %d stacked tensors in blocks): all dequantised to %s",
                    len(kept), len(stacked), str(dtype).removeprefix("torch."))
        for n in kept:
            raw[n] = raw[n].dequantize(dtype)


def _dequantized(t, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of engine/quant's types dequantised by its kernels (native, threaded; 1–2 s per GB of
    file on two cores against 20–24 s for gguf's numpy dequantise), same values: (…, cols) in `dtype`."""
    import numpy as np

    data = np.asarray(t.data)  # uint8 (…, row_bytes), a view of the map
    rows = QuantTensor.from_gguf(data.reshape(-1, data.shape[-1]), int(t.tensor_type), t.name)
    return rows.dequantize(dtype).reshape(*data.shape[:-1], rows.shape[1])


def _bf16_tensor(data) -> torch.Tensor:
    """A BF16 tensor's bytes (the reader's uint8 map, (…, 2·cols)) as a torch bf16 tensor (…, cols):
    one copy out of the map, no float32 detour (gguf's generic dequantise takes ~50 s/GB)."""
    import numpy as np

    bits = np.ascontiguousarray(data).view(np.int16)  # (…, cols) bit patterns
    return torch.from_numpy(bits.copy() if not bits.flags.writeable else bits).view(torch.bfloat16)


def _sanitize(sanitize, raw: dict, config: dict, path: Path) -> dict:
    """The family's name mapping; its errors get the file's path in front."""
    try:
        return sanitize(raw, config)
    except ModelFileError as e:
        raise ModelFileError(f"{path}: {e.what}", e.remedy) from e


# -- Hugging Face folders --------------------------------------------------------------------------

def _load_folder(path: Path, dtype: torch.dtype) -> Checkpoint:
    from safetensors import safe_open

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelFileError(f"{path} has no config.json", "point at a Hugging Face model folder")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{config_file} is not valid JSON ({e})", "restore the file from the download") from e
    family = families.for_model_type(config.get("model_type"), path)

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelFileError(f"{index} is not a valid shard index ({e})", "restore the file from the download") from e
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not shards:
        raise ModelFileError(f"{path} holds no *.safetensors weights",
                             "download the safetensors files (pickled .bin weights are not loaded)")
    raw = {}
    for shard in shards:
        shard_path = path / shard
        if not shard_path.is_file():
            raise ModelFileError(f"shard {shard} listed in {index.name} is missing from {path}",
                                 "download the missing shard")
        try:
            with safe_open(shard_path, framework="pt") as f:  # memory-mapped
                for name in f.keys():
                    raw[name] = f.get_tensor(name).to(dtype)
        except Exception as e:
            raise ModelFileError(f"{shard_path} could not be read ({e})",
                                 "the file is truncated or corrupt: download it again") from e
    tensors = _sanitize(family.sanitize_hf, raw, config, path)
    has_tokenizer = (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()
    return Checkpoint(path, family.NAME, config, tensors, tokenizer_dir=path if has_tokenizer else None)
