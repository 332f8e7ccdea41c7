"""`tandem bench suite`: the record format, the table writer, skipping, the Zipf router, the A/B worktree."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from engine.bench import routing, suite, suite_cell, suite_files, suite_gpu, suite_table
from helpers import write_tiny_llama_folder


def _ctx(trees=None, rounds=3):
    return suite_cell.Ctx(trees=trees or [suite_cell.Tree("this", suite.REPO, "a" * 40)], rounds=rounds)


def test_rounds_alternate_and_reverse_every_other_round():
    calls = []
    ctx = _ctx(rounds=4)
    out = suite_cell.alternate(ctx, {"a": lambda: calls.append("a") or {"x": 1}, "b": lambda: calls.append("b") or {"x": 2}})
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert out == {"a": [{"x": 1}] * 4, "b": [{"x": 2}] * 4}


def test_a_row_has_median_spread_and_the_median_of_per_round_ratios():
    r = suite_cell.row(_ctx(), "decode tok/s", "cond", {"tandem": [10.0, 12.0, 9.0], "llama.cpp": [20.0, 20.0, 10.0]},
                  "llama.cpp")
    t = r["systems"]["tandem"]
    assert (t["median"], t["min"], t["max"], t["spread"]) == (10.0, 9.0, 12.0, 0.3)
    assert r["ratio"]["tandem"] == {"median": 0.6, "per_round": [0.5, 0.6, 0.9]}
    assert "ab" not in r


def test_each_row_reaches_the_progress_log_as_it_is_made():
    """A run cut short before its record is written keeps the rows made so far in its log."""
    lines = []
    ctx = suite_cell.Ctx(trees=[suite_cell.Tree("this", suite.REPO, "a" * 40)], rounds=2, progress=lines.append)
    r = suite_cell.row(ctx, "decode tok/s", "cond", {"tandem": [1.0, 2.0], "llama.cpp": [2.0, 2.0]}, "llama.cpp")
    assert len(lines) == 1 and lines[0].startswith(suite_cell.ROW_PREFIX)
    assert json.loads(lines[0][len(suite_cell.ROW_PREFIX):]) == r


def test_two_trees_give_each_its_ratio_and_the_ab_ratio():
    trees = [suite_cell.Tree("this", Path("."), "1" * 40), suite_cell.Tree("against", Path("."), "1" * 40)]
    ctx = _ctx(trees)
    a, b = (t.name for t in trees)
    r = suite_cell.row(ctx, "m", "c", {a: [2.0, 4.0], b: [1.0, 1.0], "peer": [2.0, 2.0]}, "peer")
    assert set(r["ratio"]) == {a, b}
    assert r["ab"] == {"this": a, "against": b, "median": 3.0, "per_round": [2.0, 4.0]}


def _fake_cell(ctx):
    return [suite_cell.row(ctx, "decode tok/s", "tiny", {"tandem": [1.0, 2.0, 3.0], "peer": [2.0, 2.0, 2.0]}, "peer")]


def test_the_record_names_machine_commit_command_and_every_cell(monkeypatch):
    monkeypatch.setattr(suite, "cells", lambda: [
        suite_cell.Cell("fake", "a fake CPU cell", "cpu", "≥ 1×", _fake_cell),
        suite_cell.Cell("boom", "a cell that fails", "cpu", "–", lambda ctx: 1 / 0),
        suite_cell.Cell("gpu", "a CUDA cell", "cuda", "≥ 1×", _fake_cell)])
    monkeypatch.setattr(suite, "has_cuda", lambda: False)
    rec = suite.run(quick=True, cell_ids=["fake", "boom", "gpu"], progress=lambda s: None)
    json.dumps(rec)  # plain JSON
    assert rec["bench"] == "suite" and rec["rounds"] == 3
    assert {"date", "command", "machine", "load_average", "trees"} <= set(rec)
    assert len(rec["trees"][0]["commit"]) == 40
    by_id = {c["id"]: c for c in rec["cells"]}
    assert by_id["fake"]["status"] == "ran" and by_id["fake"]["command"] == "tandem bench suite --cells fake --quick"
    assert by_id["boom"]["status"] == "failed" and "ZeroDivisionError" in by_id["boom"]["reason"]
    assert by_id["gpu"] == {**by_id["gpu"], "status": "skipped", "reason": "no CUDA device", "rows": []}


def test_quick_selects_the_cpu_cells_and_every_gpu_cell_is_defined():
    cells = suite.cells()
    ids = {c.id for c in cells}
    assert {"cpu-builtin", "cpu-builtin-moe", "cpu-kernels", "cpu-busy-core", "cpu-moe-q4km-L8", "cpu-moe-q4km-L8-4k"} <= ids
    assert {"gpu-resident-L16", "gpu-hybrid-8gb-L16", "gpu-hybrid-24gb-L48", "gpu-q8-24gb-L48", "gpu-prefill-32k",
            "gpu-kv-spill"} <= ids
    assert all(c.routed for c in cells
               if c.id in ("gpu-hybrid-8gb-L16", "gpu-hybrid-24gb-L48", "gpu-q8-24gb-L48", "gpu-kv-spill"))
    assert {"gpu-gpt-oss-20b-24gb", "gpu-gpt-oss-20b-8gb", "gpu-gpt-oss-20b-mxfp4-24gb", "gpu-gpt-oss-20b-mxfp4-8gb",
            "gpu-qwen3.5-L16-q4km-8gb", "gpu-qwen3.5-L16-q4km-24gb"} <= ids
    with pytest.raises(ValueError, match="unknown cells"):
        suite.run(cell_ids=["no-such-cell"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without CUDA")
def test_gpu_cells_are_skipped_with_the_reason_here():
    rec = suite.run(cell_ids=["gpu-kv-spill", "gpu-resident-L16"], progress=lambda s: None)
    assert [(c["status"], c["reason"]) for c in rec["cells"]] == [("skipped", "no CUDA device")] * 2


def test_the_table_has_a_line_per_row_and_per_skipped_cell(monkeypatch):
    ctx = _ctx()
    record = {"date": "2026-12-01T00:00:00+00:00", "command": "tandem bench suite --quick", "rounds": 3,
              "machine": {"cpu": "X", "logical_cores": 2, "ram_gib": 8, "gpu": None, "python": "3.11", "torch": "2"},
              "load_average": {"before": 1.0, "after": 2.0},
              "trees": [{"label": "this", "commit": "abcdef0123", "files_changed": 0}],
              "cells": [{"id": "fake", "status": "ran", "reason": None, "target": "≥ 1×",
                         "command": "tandem bench suite --cells fake", "rows": _fake_cell(ctx)},
                        {"id": "gpu", "status": "skipped", "reason": "no CUDA device", "target": "≥ 2×",
                         "command": "tandem bench suite --cells gpu", "rows": []}]}
    md = suite_table.markdown(record, record_path="benchmarks/suite/x.json")
    lines = md.splitlines()
    assert "| fake | decode tok/s: tiny | 2.00 | 2.00 peer | 1.00 | 1.00–3.00; 2.00–2.00 | ≥ 1× |" in lines
    assert "| gpu | skipped: no CUDA device | – | – | – | – | ≥ 2× |" in lines
    assert "abcdef01" in md and "benchmarks/suite/x.json" in md and "shared machine" in md


def test_fitting_ncmoe_is_the_fewest_cpu_layers_within_the_budget():
    gib = 2**30
    sizes = {"expert_bytes": [1 * gib] * 10, "other_bytes": 1 * gib, "kv_bytes_per_token": 1024}
    overhead = suite_gpu.LLAMA_OVERHEAD_GIB
    # 1 GiB other + overhead + 2 GiB KV (2M tokens × 1 KiB): 6 GiB budget leaves room for floor(6 - 3 - o) layers
    n = suite_gpu.fitting_ncmoe(sizes, 6.0, 2 * 2**20)
    assert n == 10 - int(6 - 3 - overhead)
    assert suite_gpu.fitting_ncmoe(sizes, 6.0, 2 * 2**20, kv_on_host=True) == n - 2
    with pytest.raises(suite_cell.Skip):
        suite_gpu.fitting_ncmoe(sizes, 1.0, 0)


def test_batched_bench_jsonl_is_parsed():
    out = 'main: n_kv_max = 1\n{"pp": 2048, "tg": 32, "pl": 4, "speed_tg": 123.5, "speed_pp": 900.0}\n'
    assert suite_gpu.parse_batched(out)["speed_tg"] == 123.5


def test_zipf_routing_skews_the_picks_of_a_random_router():
    assert routing.parse("random") is None and routing.parse("zipf") == 1.0 and routing.label("zipf:1.2") == "zipf-1.2"
    with pytest.raises(ValueError):
        routing.parse("lru")
    target = routing.zipf_targets(64, 4, 1.0)
    assert abs(target.sum().item() - 4) < 1e-9 and target.max().item() <= routing.CAP + 1e-9
    hidden = 256
    w = torch.randn(64, hidden, generator=torch.Generator().manual_seed(0)) / hidden ** 0.5
    h = torch.randn(4000, hidden, generator=torch.Generator().manual_seed(1))

    def rates(weight):
        picks = (h @ weight.T).topk(4, dim=1).indices.flatten()
        return torch.bincount(picks, minlength=64).double().sort(descending=True).values / len(h)

    flat, skewed = rates(w), rates(routing.skew_router(w, 1.0, layer=0, top_k=4))
    assert flat[0] < 0.15  # random: near 4/64 each
    assert skewed[0] > 0.3 and skewed[-8:].mean() < 0.03  # hot experts near the cap, a cold tail
    assert not torch.equal(routing.skew_router(w, 1.0, 0, 4), routing.skew_router(w, 1.0, 1, 4))  # per-layer order


def test_ab_against_a_worktree_runs_each_tree_on_its_own_code(tmp_path, monkeypatch):
    """One round, a 2-layer model, 4 tokens: the worktree's probe imports the worktree's engine."""
    model = write_tiny_llama_folder(tmp_path / "tiny")
    seen = {}

    def tiny_cell(ctx):
        spec = {"config": {"model": str(model), "backend": "tandem", "device": "cpu", "cpu_threads": 1},
                "vocab": 64, "decode_prompt": 8, "new_tokens": 4, "warmup": False}
        systems = {n: (lambda t=ctx.tree_of(n): suite_cell.probe(t.path, spec)) for n in ctx.tandem_names()}
        systems["peer"] = lambda: suite_cell.probe(ctx.trees[0].path, spec)
        res = suite_cell.alternate(ctx, systems)
        seen.update({n: (rs[0]["tree"], ctx.tree_of(n).path if n != "peer" else None) for n, rs in res.items()})
        return [suite_cell.row(ctx, "decode tok/s", "tiny", {n: [r["decode_tok_s"] for r in rs] for n, rs in res.items()},
                          "peer")]

    monkeypatch.setattr(suite, "cells", lambda: [suite_cell.Cell("tiny", "tiny A/B", "cpu", "–", tiny_cell)])
    rec = suite.run(cell_ids=["tiny"], rounds=1, against="HEAD", progress=lambda s: None)
    cell = rec["cells"][0]
    assert cell["status"] == "ran", cell["reason"]
    this, other = rec["trees"]
    assert other["label"] == "against" and len(other["commit"]) == 40
    row = cell["rows"][0]
    names = list(row["ratio"])
    assert len(names) == 2 and names[1] == f"tandem@{other['commit'][:8]} (against)" and row["ab"]["median"]
    for name, (ran_in, expected) in seen.items():
        if expected is not None:
            assert Path(ran_in).resolve() == Path(expected).resolve(), name
    worktree = seen[names[1]][1]
    assert worktree != suite.REPO and not Path(worktree).exists()  # removed after the run
    listed = subprocess.run(["git", "worktree", "list"], cwd=suite.REPO, capture_output=True, text=True).stdout
    assert str(worktree) not in listed


def test_gguf_sizes_reads_the_kv_shape_and_expert_bytes_from_the_file(tmp_path):
    from helpers import TINY, write_tiny_llama_gguf

    sizes = suite_files.gguf_sizes(write_tiny_llama_gguf(tmp_path / "tiny.gguf"))
    head_dim = TINY["dim"] // TINY["heads"]
    assert sizes["expert_bytes"] == []  # a dense model: nothing for -ncmoe to move
    assert sizes["kv_bytes_per_token"] == 2 * TINY["kv_heads"] * head_dim * 2 * TINY["layers"]
    assert sizes["other_bytes"] > 0


def test_a_quantised_presets_export_size_is_its_files_tensor_bytes(tmp_path, monkeypatch):
    """The disk check of a preset with quantised experts counts their blocks, not BF16: the 48-layer
    Q8_0 cell's file is 33 GB, which a 64 GB disk holds, where the BF16 export's 60 GB did not."""
    import gguf

    from engine.bench import gguf_export
    from engine.models import synthetic

    tiny = dict(synthetic.PRESETS["qwen3-30b-a3b"], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-qwen3", tiny)
    for name in ("synthetic:tiny-qwen3-Q8_0", "synthetic:tiny-qwen3"):
        out = tmp_path / f"{name.split(':')[1]}.gguf"
        gguf_export.export(name, out)  # the built-in tokenizer's 49,152 tokens, as export_bytes assumes
        written = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(out)).tensors)
        assert suite_files.export_bytes(name) == written, name
    assert 32e9 < suite_files.export_bytes(suite_gpu.L48_Q8) < 34e9


def test_the_export_size_is_known_before_writing(tmp_path, monkeypatch):
    # 16 layers of Qwen3-30B-A3B with the borrowed 49,152-token vocabulary: the recorded export was 20.35 GB
    assert 20.0e9 < suite_files.export_bytes(suite_gpu.L16) < 20.7e9
    assert suite_files.export_bytes(suite_gpu.L48) > 2.9 * suite_files.export_bytes(suite_gpu.L16)
    ctx = suite_cell.Ctx(trees=[], work=tmp_path)
    monkeypatch.setattr(suite_files.shutil, "disk_usage", lambda p: type("U", (), {"free": 10**9})())
    with pytest.raises(suite_cell.Skip, match="needs 60 GB of disk"):
        suite_files.gguf_for(ctx, suite_gpu.L48, "zipf:1.0")


def test_an_ab_table_gives_the_ab_ratio_once_per_measure():
    trees = [suite_cell.Tree("this", Path("."), "1" * 40), suite_cell.Tree("against", Path("."), "2" * 40)]
    ctx = _ctx(trees)
    a, b = (t.name for t in trees)
    record = {"date": "d", "command": "c", "rounds": 2, "machine": {}, "cells": [
                  {"id": "x", "status": "ran", "reason": None, "target": "t", "command": "c",
                   "rows": [suite_cell.row(ctx, "m", "c", {a: [2.0, 4.0], b: [1.0, 1.0], "peer": [2.0, 2.0]}, "peer")]}],
              "trees": [{"label": "this", "commit": "1" * 40}, {"label": "against", "commit": "2" * 40}]}
    lines = [x for x in suite_table.markdown(record).splitlines() if x.startswith("| x |")]
    assert len(lines) == 2 and lines[0].split(" | ")[6] == "3.00" and lines[1].split(" | ")[6] == "–"


def _stub_decode_cell(monkeypatch, spec_key: str) -> list:
    """The decode cell's engines stubbed: the probe answers 2 tok/s, llama.cpp 1; returns the list the
    probes' `spec[spec_key]` lands in."""
    seen = []
    monkeypatch.setattr(suite_gpu, "llama_binaries", lambda c: {"llama-bench": "x", "llama-batched-bench": "y"})
    monkeypatch.setattr(suite_gpu, "gguf_for", lambda c, m, r: Path("model.gguf"))
    monkeypatch.setattr(suite_gpu, "probe", lambda tree, spec: seen.append(spec[spec_key]) or {"decode_tok_s": 2.0})
    monkeypatch.setattr(suite_gpu, "llama_decode", lambda *a: 1.0)
    return seen


def test_contexts_narrow_the_gpu_decode_cells(monkeypatch):
    ctx = _ctx(rounds=1)
    ctx.contexts = (32768,)
    seen = _stub_decode_cell(monkeypatch, "decode_prompt")
    rows = suite_gpu.decode_cell(ctx, suite_gpu.L16, None, (2048, 32768), (1,))
    assert seen == [32768] and [r["ratio"]["tandem"]["median"] for r in rows] == [2.0]
    ctx.contexts = (4096,)
    with pytest.raises(suite_cell.Skip, match="contexts"):
        suite_gpu.decode_cell(ctx, suite_gpu.L16, None, (2048, 32768), (1,))


def test_chats_narrow_the_gpu_decode_cells(monkeypatch):
    ctx = _ctx(rounds=1)
    ctx.chats = (1,)
    seen = _stub_decode_cell(monkeypatch, "batch")
    rows = suite_gpu.decode_cell(ctx, suite_gpu.L16, None, (2048,), (1, 4))
    assert seen == [1] and len(rows) == 1
    ctx.chats = (2,)
    with pytest.raises(suite_cell.Skip, match="chat counts"):
        suite_gpu.decode_cell(ctx, suite_gpu.L16, None, (2048,), (1, 4))


def test_the_prefill_cell_keeps_the_rows_of_the_model_whose_export_fits(monkeypatch):
    ctx = _ctx(rounds=1)
    ctx.routings = ("random",)

    def gguf_for(c, model, routing):
        if model == suite_gpu.L48:
            raise suite_cell.Skip("the export needs 123 GB of disk")
        return Path("l16.gguf")

    monkeypatch.setattr(suite_gpu, "llama_binaries", lambda c: {})
    monkeypatch.setattr(suite_gpu, "gguf_for", gguf_for)
    monkeypatch.setattr(suite_gpu, "gguf_sizes", lambda p: {"expert_bytes": [1] * 16, "other_bytes": 0,
                                                            "kv_bytes_per_token": 0})
    specs = []
    monkeypatch.setattr(suite_gpu, "probe", lambda tree, spec: specs.append(spec) or {"prefill_tok_s": 300.0})
    monkeypatch.setattr(suite_gpu, "llama_prefill", lambda *a: 100.0)
    rows = suite_gpu.prefill_cell(ctx)
    assert len(rows) == 1 and "qwen3-30b-a3b-L16" in rows[0]["condition"]
    assert rows[0]["ratio"]["tandem"]["median"] == 3.0
    # one chat's KV, as llama-bench's one sequence: the default max_batch would plan for four 32K chats
    assert [s["config"]["max_batch"] for s in specs] == [1]


def test_the_gpt_oss_preset_is_exportable_with_llamacpps_names():
    """The gpt-oss cells export `synthetic:gpt-oss-20b`: its shape passes the export's checks and
    plans llama.cpp's tensors (sinks, post-attention norm, expert biases), 40 GB in BF16."""
    from engine.bench import gguf_export
    from engine.models import families, synthetic
    from engine.models.assemble import tensor_shapes

    config = synthetic.config_for(suite_gpu.GPT_OSS + "-L2", vocab_size=49152)
    args = families.for_model_type(config["model_type"], Path("x")).args_from_config(config)
    gguf_export._check_exportable("gpt-oss", args)
    names = {p.gguf_name for p in gguf_export.plan("gpt-oss", args, tensor_shapes(args))}
    assert {"blk.1.attn_sinks.weight", "blk.1.post_attention_norm.weight", "blk.0.ffn_gate_exps.bias",
            "blk.0.ffn_up_exps.bias", "blk.0.ffn_down_exps.bias", "blk.0.attn_q.bias"} <= names
    assert 38e9 < suite_files.export_bytes(suite_gpu.GPT_OSS) < 44e9


def test_a_one_load_cell_loads_each_system_once_for_every_context(monkeypatch):
    """The family cells: one probe (every context in `decode_prompts`, planned for the largest) and
    one llama-bench run (`-d` a list, -ncmoe fitted to the largest context's KV) give a row per context."""
    from engine.bench import llamacpp_bench

    ctx = _ctx(rounds=1)
    ctx.routings = ("random",)
    specs, llama_calls, fits = [], [], []
    monkeypatch.setattr(suite_gpu, "llama_binaries", lambda c: {"llama-bench": "x"})
    monkeypatch.setattr(suite_gpu, "gguf_for", lambda c, m, r: Path("model.gguf"))
    monkeypatch.setattr(suite_gpu, "gguf_sizes", lambda p: "sizes")
    monkeypatch.setattr(suite_gpu, "fitting_ncmoe", lambda sizes, budget, tokens: fits.append(tokens) or 7)
    monkeypatch.setattr(suite_gpu, "probe", lambda tree, spec: specs.append(spec) or {
        "decode_tok_s_by_prompt": {"2048": 60.0, "32768": 40.0}, "prefill_tok_s_by_prompt": {"2048": 900.0}})
    monkeypatch.setattr(llamacpp_bench, "run", lambda *a, **kw: llama_calls.append(kw) or {"results": (
        [{"n_depth": 2048, "tok_s": 30.0}, {"n_depth": 32768, "tok_s": 20.0}] if kw["n_gen"] else
        [{"n_prompt": 2048, "tok_s": 450.0}, {"n_prompt": 32768, "tok_s": 300.0}])})
    rows = suite_gpu.one_load_decode_cell(ctx, suite_gpu.GPT_OSS, 8.0, (2048, 32768))
    assert len(specs) == 1 and specs[0]["decode_prompts"] == [2048, 32768]
    assert specs[0]["config"]["max_context"] > 32768 and fits == [32768 + suite_gpu.NEW_TOKENS]
    decode, prefill = llama_calls  # llama.cpp: one run for the decodes, one for the prefills
    assert decode["depth"] == [2048, 32768] and decode["n_prompt"] == 0 and decode["n_cpu_moe"] == 7
    assert prefill["n_prompt"] == [2048, 32768] and prefill["n_gen"] == 0 and prefill["n_cpu_moe"] == 7
    assert [(r["metric"], r["ratio"]["tandem"]["median"]) for r in rows] == [
        ("decode tok/s", 2.0), ("prefill tok/s", 2.0), ("decode tok/s", 2.0), ("prefill tok/s", None)]
    assert rows[2]["llama_flags"].endswith("-ncmoe 7")


def test_the_probe_decodes_each_of_several_prompt_lengths_with_one_load():
    spec = {"config": {"model": "builtin:smollm2-135m", "backend": "tandem", "device": "cpu", "max_context": 256},
            "decode_prompts": [8, 40], "new_tokens": 3, "warmup": False}
    out = suite_cell.probe(suite.REPO, spec)
    assert set(out["decode_tok_s_by_prompt"]) == {"8", "40"} and all(v > 0 for v in out["decode_tok_s_by_prompt"].values())
    assert out["prefill_tok_s_by_prompt"]["40"] > 0 and "decode_tok_s" not in out
    # the engine's counters come back beside the figures: where a cell's time went
    assert set(out["stats"]) == {"experts", "pcie", "kernels"} and out["stats"]["kernels"]


def test_the_cpu_moe_cell_makes_its_file_once_and_stays_out_of_quick(tmp_path, monkeypatch):
    from engine.bench import suite_cpu_quant

    cell = next(c for c in suite.cells() if c.id == "cpu-moe-q4km-L8")
    assert cell.needs == "cpu" and not cell.in_quick  # --quick stays minutes: no 10 GB export on its way
    ctx = suite_cell.Ctx(trees=[], work=tmp_path)
    made = tmp_path / "qwen3-30b-a3b-L8-Q4_K_M.gguf"
    made.write_bytes(b"GGUF")
    assert suite_cpu_quant.quantised_file(ctx, suite_cpu_quant.MODEL) == made  # made once: an existing file is used as it is
    made.unlink()
    monkeypatch.setattr(suite_cpu_quant.shutil, "disk_usage", lambda p: type("U", (), {"free": 10**9})())
    pytest.importorskip("llama_cpp")
    with pytest.raises(suite_cell.Skip, match="GB of disk"):
        suite_cpu_quant.quantised_file(ctx, suite_cpu_quant.MODEL)


@pytest.mark.parametrize("threads", [None, 1])
def test_the_cpu_moe_cell_runs_both_engines_at_the_threads_asked(tmp_path, monkeypatch, threads):
    """--threads reaches both engines' configs and the rows' condition; without it both keep their
    default threads (Tandem's chooser, llama.cpp's)."""
    from engine.bench import suite_cpu_quant

    (tmp_path / "qwen3-30b-a3b-L8-Q4_K_M.gguf").write_bytes(b"GGUF")
    configs = []
    monkeypatch.setattr(suite_cpu_quant, "probe", lambda tree, spec: configs.append(spec["config"]) or
                        {"decode_tok_s": 2.0, "prefill_tok_s": 3.0})
    ctx = suite_cell.Ctx(trees=[suite_cell.Tree("this", suite.REPO, "a" * 40)], rounds=1, work=tmp_path, threads=threads)
    rows = suite_cpu_quant.decode_and_prefill(ctx, suite_cpu_quant.MODEL)
    assert {c["backend"] for c in configs} == {"tandem", "llamacpp"}
    assert all(c.get("cpu_threads") == threads for c in configs)
    assert all(("1 threads" if threads else "default threads") in r["condition"] for r in rows)


def test_warm_up_prompt_reaches_the_timed_prefills_paths():
    from engine.bench.suite_probe import warmup_prompt

    assert warmup_prompt({"decode_prompt": 32, "new_tokens": 24}) == 16  # decode only: a short warm-up
    assert warmup_prompt({"prefill": 64}) == 64  # the prompt the cell times, as llama-bench warms up
    assert warmup_prompt({"decode_prompts": [2048, 32768]}) == 32768  # the longest of them
    assert warmup_prompt({"prefill": 32768, "decode_prompt": 32}) == 32768


def test_the_dense_cpu_cell_runs_both_engines_on_the_dense_file(tmp_path, monkeypatch):
    """The figure behind backend auto's rule for dense files: both engines on Llama-3.2-1B's shapes."""
    from engine.bench import suite_cpu_quant

    cell = next(c for c in suite.cells() if c.id == "cpu-dense-q4km")
    assert cell.needs == "cpu" and not cell.in_quick
    made = tmp_path / "llama-3.2-1b-Q4_K_M.gguf"
    made.write_bytes(b"GGUF")
    configs = []
    monkeypatch.setattr(suite_cpu_quant, "probe", lambda tree, spec: configs.append(spec["config"]) or
                        {"decode_tok_s": 2.0, "prefill_tok_s": 3.0})
    ctx = suite_cell.Ctx(trees=[suite_cell.Tree("this", suite.REPO, "a" * 40)], rounds=1, work=tmp_path)
    rows = suite_cpu_quant.decode_and_prefill(ctx, suite_cpu_quant.DENSE)
    assert {c["model"] for c in configs} == {str(made)} and {c["backend"] for c in configs} == {"tandem", "llamacpp"}
    assert [r["metric"] for r in rows] == ["decode tok/s", "prefill tok/s"]
