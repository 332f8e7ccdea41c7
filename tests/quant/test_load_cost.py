"""Issue #33's load targets, held cheaply (the measured figures: engine/bench/load_cost.py,
benchmarks/RESULTS.md): loading a quantised GGUF on the CPU reads its header once without decoding the
vocabulary, keeps every matrix and routed expert as a view of the file's map (nothing dequantised into
the heap), and the measurement module's arithmetic checks the issue's bounds.

The vocabulary was the load's cost: gguf's reader decoded each of SmolLM2's 49152 tokens and 48900
merges through numpy views, ~10 s a read on the 2-core machine, twice a load (the plan's shape, then the
weights): 30 s of a 33 s load of the 0.1 GB built-in file; a 151936-token vocabulary costs ~3x that.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from test_quant_experts_gguf import write_quantised

from engine.api import Engine, EngineConfig
from engine.bench import load_cost
from engine.models import shape
from engine.models.builtin import smollm2_gguf
from engine.models.loader import SKIPPED_ARRAYS, gguf_reader, load_checkpoint
from engine.quant.blocks import QuantTensor
from engine.quant.modules import QuantEmbedding, QuantLinear

pytest.importorskip("llama_cpp")

MB = 10**6


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    return write_quantised(tmp_path_factory.mktemp("load-cost"), "qwen3_moe", "Q4_K_M")


def test_reader_steps_over_the_vocabulary_and_reads_the_rest_alike(moe_file):
    plain, fast = gguf.GGUFReader(moe_file), gguf_reader(moe_file)
    assert list(plain.fields) == list(fast.fields)
    for key, field in plain.fields.items():
        if key.startswith(SKIPPED_ARRAYS) and field.types[0] == gguf.GGUFValueType.ARRAY:
            assert fast.fields[key].types == field.types and fast.fields[key].contents() == []
        else:
            assert fast.fields[key].contents() == field.contents(), key
    assert fast.data_offset == plain.data_offset
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in fast.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in plain.tensors]


def test_reader_falls_back_to_ggufs_own_where_its_internals_changed(moe_file, monkeypatch):
    """The fast reader overrides gguf's private field loop: where a release changed it, the file is
    still read (by gguf's reader, vocabulary and all), not reported damaged."""
    from engine.models import loader

    def changed(path):
        raise AttributeError("'GGUFReader' object has no attribute '_push_field'")

    monkeypatch.setattr(loader, "_fast_reader", changed)
    reader = gguf_reader(moe_file)
    assert type(reader) is gguf.GGUFReader and reader.fields["tokenizer.ggml.tokens"].contents()
    assert load_checkpoint(str(moe_file)).family == "qwen3_moe"


def test_plan_and_load_decode_no_vocabulary(monkeypatch):
    """The plan's shape and the loader read the built-in file's header without a string read per
    token or merge (98052 of them): a few hundred reads (keys and tensor names), not ~10^5."""
    reads = []
    plain_get_str = gguf.GGUFReader._get_str
    monkeypatch.setattr(gguf.GGUFReader, "_get_str", lambda self, offs: reads.append(1) or plain_get_str(self, offs))
    shape.model_args(str(smollm2_gguf()))
    load_checkpoint(smollm2_gguf(), torch.float32, quantised=True)
    assert 0 < len(reads) < 2000


def _file_maps(path) -> list[tuple[int, int]]:
    """Address ranges of this process's maps of `path` (/proc/self/maps)."""
    import os

    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == real:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi))
    return out


def test_loaded_weights_are_views_of_the_file_map(moe_file):
    """Default CPU load (dtype auto, experts resident): every matrix and routed expert in blocks that
    point into the file's map; the heap holds only what the file has as F32 (norms, routers)."""
    engine = Engine(EngineConfig(model=moe_file, backend="tandem", device="cpu", max_batch=1))
    try:
        parts = engine.parts
        maps = _file_maps(moe_file)
        assert maps

        def in_map(t: torch.Tensor) -> bool:
            return any(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi for lo, hi in maps)

        blocks = [m.qweight for m in parts.model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
        assert blocks and all(in_map(q.blocks) for q in blocks)
        experts = [e for stack in (*parts.experts.gate_up, *parts.experts.down) for e in stack.experts]
        leaves = [p for e in experts for p in getattr(e, "parts", [e])]
        assert len(experts) == 2 * 2 * 8 and all(isinstance(q, QuantTensor) and in_map(q.blocks) for q in leaves)
        heap = {n: p for n, p in parts.model.named_parameters() if not in_map(p)}
        # nothing but vectors and the routers (the F32 tensors of a llama.cpp Q4_K_M file)
        assert all(p.dim() == 1 or n.endswith("mlp.gate.weight") for n, p in heap.items()), \
            sorted(n for n, p in heap.items() if p.dim() > 1)
        assert engine.generate_ids([3, 17, 5], 1)  # and it runs
    finally:
        engine.close()


def test_targets_arithmetic():
    """1.15 × file + KV + 1 GiB and 2 × the read, on a made-up run."""
    gib = 2**30
    run = {"kv_bytes": gib, "load_s": 3.0, "first_token_s": 1.0,
           "memory": {"after_token": {"rss": 2 * gib, "anon": gib, "peak_rss": 3 * gib}}}
    t = load_cost.targets(4 * gib, 2.0, run)
    assert t["memory_allowed_bytes"] == int(1.15 * 4 * gib + 2 * gib)
    assert t["memory_met"] and t["load_met"] and t["load_over_read"] == 1.5
    assert not load_cost.targets(4 * gib, 1.0, run)["load_met"]
    run["memory"]["after_token"]["anon"] = 3 * gib  # anon + file 7 GiB > 6.6 GiB allowed
    assert not load_cost.targets(4 * gib, 2.0, run)["memory_met"]


def test_read_and_cache_probe(tmp_path):
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * (3 * MB))
    assert load_cost.read_file(str(f))["bytes"] == 3 * MB
    frac = load_cost.cached_fraction(str(f))
    assert frac is None or 0.0 <= frac <= 1.0
    load_cost.cold(str(f))  # permitted or not, it answers


def test_plan_sizes_a_quantised_file_by_its_blocks(moe_file):
    """The CPU plan (dtype auto) counts what the load holds: blocks at their size in the file, the F32
    norms and routers as they are; not every weight as float32 (which refused a 3.2 GB Q4_K_M file
    as 19.3 GiB on a 24 GiB machine)."""
    import os

    from engine.models.loader import held_bytes
    from engine.runtime.planning import _in_blocks
    from engine.models.sizes import model_parts

    held = held_bytes(moe_file, "qwen3_moe", 4)
    tensors = gguf_reader(moe_file).tensors
    assert sum(held.values()) == sum(int(t.n_bytes) for t in tensors)  # nothing here is dequantised
    assert held["experts"] == sum(int(t.n_bytes) for t in tensors if "_exps" in t.name)
    args = shape.model_args(moe_file)
    float_parts = model_parts(args, 4, moe_file)
    parts = _in_blocks(float_parts, moe_file, args, 4)
    weights = lambda p: p.dense_bytes + p.moe_layers * p.n_experts * p.expert_bytes  # noqa: E731
    assert weights(parts) <= os.path.getsize(moe_file) < weights(float_parts) / 4



def test_float_load_dequantises_each_block_type_as_gguf_does(moe_file):
    """A float load dequantises engine/quant's types by its own kernels (~15× gguf's numpy): every
    tensor of the file, stacked experts included, comes out bit-equal to gguf's dequantise."""
    import numpy as np
    from gguf.quants import dequantize

    from engine.models.loader import _dequantized
    from engine.quant.blocks import QTYPES

    seen = set()
    for t in gguf_reader(moe_file).tensors:
        if int(t.tensor_type) not in QTYPES:
            continue
        seen.add(t.tensor_type.name)
        want = dequantize(t.data, t.tensor_type)
        got = _dequantized(t, torch.float32).numpy()
        assert got.shape == want.shape and np.array_equal(got, want), t.name
    assert {"Q4_K", "Q6_K"} <= seen


def _mapped_bytes(path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: range perms offset dev inode [path]
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux's /proc")
@pytest.mark.parametrize("advice", ["madvise", "touch"])
def test_blocks_kept_as_views_are_mapped_at_load(moe_file, monkeypatch, advice):
    """The blocks a quantised load keeps as views of the file are paged in by the load (as llama.cpp's
    MAP_POPULATE), not by the decode steps that first route to them; where the kernel lacks the advice,
    a read a page does it."""
    from engine.models import loader

    if advice == "touch":
        monkeypatch.setattr(loader, "MADV_POPULATE_READ", -1)  # refused: EINVAL
    ckpt = load_checkpoint(str(moe_file), torch.float32, quantised=True)
    kept = sum(t.nbytes for t in ckpt.tensors.values() if isinstance(t, QuantTensor))
    experts = [t for t in ckpt.tensors.values() if hasattr(t, "experts")]
    kept += sum(s.nbytes for s in experts)
    assert kept > 0 and _mapped_bytes(moe_file) >= 0.9 * kept
