"""The suite's Q4_K_M cells (issue #33): the cells and their targets, the `llama-quantize` command,
the quantised file made once, what each cell gives each system, and that llama.cpp's quantiser takes
the suite's BF16 export. No GPU: the cells' runs are checked with the engines stubbed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.bench import llamacpp_bench, suite, suite_cell, suite_files, suite_gpu

QUANT_CELLS = ("gpu-q4km-L16-cpu-experts", "gpu-q4km-L16-8gb", "gpu-q4km-L16-resident", "gpu-q4km-prefill-32k")


def _ctx(tmp_path=None, rounds=1):
    ctx = suite_cell.Ctx(trees=[suite_cell.Tree("this", suite.REPO, "a" * 40)], rounds=rounds, routings=("random",))
    if tmp_path is not None:
        ctx.work = tmp_path
    return ctx


def _cell(cell_id):
    return next(c for c in suite.cells() if c.id == cell_id)


def test_the_quantised_cells_carry_issue_33s_targets():
    cells = {c.id: c for c in suite.cells() if c.id in QUANT_CELLS}
    assert set(cells) == set(QUANT_CELLS) and all(c.needs == "cuda" and "Q4_K_M" in c.title for c in cells.values())
    assert cells["gpu-q4km-L16-cpu-experts"].target == "decode ≥ 1.2× llama.cpp -ngl 99 -ncmoe 16"
    assert cells["gpu-q4km-L16-8gb"].target == "decode ≥ 1.5× llama.cpp"
    assert cells["gpu-q4km-L16-resident"].target == "decode ≥ 1× llama.cpp"
    assert cells["gpu-q4km-prefill-32k"].target == "prefill ≥ 3× llama.cpp"
    # only the cells that offload experts to a cache are reported under every routing
    assert [c.routed for c in cells.values()] == [False, True, False, True]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without CUDA")
def test_the_quantised_cells_are_skipped_with_the_reason_here():
    rec = suite.run(cell_ids=list(QUANT_CELLS), progress=lambda s: None)
    assert [(c["status"], c["reason"]) for c in rec["cells"]] == [("skipped", "no CUDA device")] * 4


def test_the_quantise_command_is_llama_quantizes_own():
    cmd = suite_files.quantise_command("/b/llama-quantize", Path("/w/m.gguf"), Path("/w/m-Q4_K_M.gguf"), "Q4_K_M", 16)
    assert cmd == ["/b/llama-quantize", "/w/m.gguf", "/w/m-Q4_K_M.gguf", "Q4_K_M", "16"]
    ctx = _ctx(Path("/w"))
    assert suite_files.export_path(ctx, suite_gpu.L16, None) == Path("/w/qwen3-30b-a3b-L16-random.gguf")
    assert suite_files.export_path(ctx, suite_gpu.L16, "zipf:1.0", "Q4_K_M") == Path(
        "/w/qwen3-30b-a3b-L16-zipf-1-Q4_K_M.gguf")


@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
    """llama.cpp's build, the BF16 export and `llama-quantize` stubbed; `free` is the disk's free bytes."""
    state = {"free": 10**12, "free_after": 10**12, "runs": [], "targets": []}

    def export(ctx, model, routing):
        path = suite_files.export_path(ctx, model, routing)
        path.write_bytes(b"bf16")
        return path

    def quantise(cmd):
        state["runs"].append(cmd)
        Path(cmd[2]).write_bytes(b"q4")
        state["free"] = state["free_after"]  # the new file took its room
        return ""

    monkeypatch.setattr(suite_files, "llama_binaries", lambda ctx, targets=suite_files.BENCH_TARGETS: (
        state["targets"].append(targets) or {t: f"/bin/{t}" for t in targets}))
    monkeypatch.setattr(suite_files, "gguf_for", export)
    monkeypatch.setattr(suite_files, "run_tool", quantise)
    monkeypatch.setattr(suite_files.shutil, "disk_usage", lambda p: type("U", (), {"free": state["free"]})())
    return state


def test_the_quantised_file_is_made_once_by_llama_quantize(tmp_path, fake_tools):
    ctx = _ctx(tmp_path)
    out = suite_files.quantised_for(ctx, suite_gpu.L16, "random")
    assert out == tmp_path / "qwen3-30b-a3b-L16-random-Q4_K_M.gguf" and out.read_bytes() == b"q4"
    (cmd,) = fake_tools["runs"]
    assert cmd[0] == "/bin/llama-quantize" and cmd[1] == str(tmp_path / "qwen3-30b-a3b-L16-random.gguf")
    assert cmd[2] == str(out) + ".partial" and cmd[3] == "Q4_K_M"  # renamed once whole
    assert "llama-quantize" in fake_tools["targets"][0]
    assert (tmp_path / "qwen3-30b-a3b-L16-random.gguf").exists()  # room left: the BF16 export is kept
    assert suite_files.quantised_for(ctx, suite_gpu.L16, "random") == out and len(fake_tools["runs"]) == 1


def test_the_bf16_export_goes_when_the_disk_would_not_hold_another(tmp_path, fake_tools):
    fake_tools["free_after"] = suite_files.export_bytes(suite_gpu.L16) - 1
    suite_files.quantised_for(_ctx(tmp_path), suite_gpu.L16, None)
    assert not (tmp_path / "qwen3-30b-a3b-L16-random.gguf").exists()
    assert (tmp_path / "qwen3-30b-a3b-L16-random-Q4_K_M.gguf").exists()


def test_no_quantising_without_the_disk_for_the_export_and_its_file(tmp_path, fake_tools):
    bf16 = suite_files.export_bytes(suite_gpu.L16)
    fake_tools["free"] = bf16  # the export fits, the quantised file beside it does not
    with pytest.raises(suite_cell.Skip, match="needs about 27 GB of disk, 20 GB free"):
        suite_files.quantised_for(_ctx(tmp_path), suite_gpu.L16, None)
    assert fake_tools["runs"] == [] and not list(tmp_path.iterdir())


@pytest.fixture
def stub_engines(monkeypatch):
    """Both systems stubbed: what each cell asked of Tandem (specs) and of llama-bench (calls)."""
    seen = {"specs": [], "llama": [], "files": []}
    monkeypatch.setattr(suite_gpu, "llama_binaries", lambda ctx, targets=(): {"llama-bench": "llama-bench"})
    monkeypatch.setattr(suite_gpu, "quantised_for", lambda ctx, model, routing: seen["files"].append(
        (model, routing)) or Path("q4km.gguf"))
    monkeypatch.setattr(suite_gpu, "gguf_sizes", lambda p: {"expert_bytes": [2**30] * 16, "other_bytes": 2**30,
                                                            "kv_bytes_per_token": 1024})
    monkeypatch.setattr(suite_gpu, "probe", lambda tree, spec: seen["specs"].append(spec) or {
        "decode_tok_s_by_prompt": {"2048": 60.0, "32768": 40.0},
        "prefill_tok_s_by_prompt": {"2048": 900.0, "32768": 600.0}, "prefill_tok_s": 900.0})
    monkeypatch.setattr(llamacpp_bench, "run", lambda *a, **kw: seen["llama"].append(kw) or {"results": (
        [{"n_depth": 2048, "tok_s": 30.0}, {"n_depth": 32768, "tok_s": 20.0}] if kw["n_gen"] else
        [{"n_prompt": 2048, "tok_s": 300.0}, {"n_prompt": 32768, "tok_s": 200.0}])})
    monkeypatch.setattr(suite_gpu, "llama_prefill", lambda bins, g, n, m: seen["llama"].append(
        {"n_prompt": n, "n_cpu_moe": m}) or 300.0)
    return seen


def test_experts_on_the_cpu_give_tandem_cpu_only_and_llama_cpp_ncmoe_16(stub_engines):
    rows = _cell("gpu-q4km-L16-cpu-experts").run(_ctx())
    (spec,) = stub_engines["specs"]
    assert spec["config"]["model"] == "q4km.gguf" and spec["config"]["expert_policy"] == "cpu-only"
    assert "vram_budget_gb" not in spec["config"] and "kv_policy" not in spec["config"]  # its plan otherwise
    assert [c["n_cpu_moe"] for c in stub_engines["llama"]] == [16, 16] and stub_engines["files"] == [
        (suite_gpu.L16, None)]
    assert {r["llama_flags"] for r in rows} == {"-ngl 99 -fa 1 -ncmoe 16"}
    assert all("routed experts on the CPU" in r["condition"] for r in rows)
    assert [r["ratio"]["tandem"]["median"] for r in rows] == [2.0, 3.0, 2.0, 3.0]


def test_everything_on_the_gpu_gives_no_policy_and_no_ncmoe(stub_engines):
    rows = _cell("gpu-q4km-L16-resident").run(_ctx())
    (spec,) = stub_engines["specs"]
    assert set(spec["config"]) == {"model", "backend", "max_context", "max_batch"}
    assert [c["n_cpu_moe"] for c in stub_engines["llama"]] == [None, None]
    assert {r["llama_flags"] for r in rows} == {"-ngl 99 -fa 1"} and "all on the GPU" in rows[0]["condition"]


def test_the_8gb_cells_fit_llama_cpps_ncmoe_and_give_tandem_the_budget_alone(stub_engines):
    rows = _cell("gpu-q4km-L16-8gb").run(_ctx())
    spec, bf16_store = stub_engines["specs"]  # beside the default: the same file's experts dequantised
    assert set(spec["config"]) == {"model", "backend", "max_context", "max_batch", "vram_budget_gb"}
    assert bf16_store["config"] == {**spec["config"], "dtype": "bfloat16"}
    assert set(rows[0]["systems"]) == {"tandem", "tandem, BF16 store", "llama.cpp"} and set(rows[0]["ratio"]) == {"tandem"}
    # 8 GiB less 1 GiB of other weights, KV of 32K tokens at 1 KiB and the overhead: 5 layers' experts fit
    ncmoe = suite_gpu.fitting_ncmoe(suite_gpu.gguf_sizes(None), 8.0, 32768 + suite_gpu.NEW_TOKENS)
    assert ncmoe == 11 and {r["llama_flags"] for r in rows} == {"-ngl 99 -fa 1 -ncmoe 11"}
    assert "VRAM 8 GB" in rows[0]["condition"] and stub_engines["files"] == [(suite_gpu.L16, "random")]
    stub_engines["specs"].clear()
    prefill = _cell("gpu-q4km-prefill-32k").run(_ctx())
    assert len(prefill) == 1 and stub_engines["specs"][0]["prefill"] == 32768
    assert stub_engines["specs"][0]["config"]["vram_budget_gb"] == 8.0 and "expert_policy" not in spec["config"]
    assert prefill[0]["llama_flags"] == "-ngl 99 -fa 1 -ncmoe 11" and prefill[0]["ratio"]["tandem"]["median"] == 3.0


def test_llama_cpps_quantiser_takes_the_suites_bf16_export(tmp_path):
    """A tiny Qwen3-MoE written as the suite's BF16 export, quantised by llama.cpp's quantiser (its
    library here; the cells run its `llama-quantize` binary, same code): the experts come out in K-quant
    blocks, `gguf_sizes` reads their bytes for the -ncmoe fit, and they are within QUANT_OF_BF16 of BF16."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import gguf

    from engine.bench import gguf_export
    from engine.models import families, synthetic

    name, vocab = "synthetic:qwen3-30b-a3b-L2", 256
    config = synthetic.config_for(name, vocab_size=vocab)
    # K-quants need whole 256-weight rows, else llama.cpp falls back to other types
    config.update({"hidden_size": 256, "moe_intermediate_size": 256, "num_attention_heads": 4, "head_dim": 64,
                   "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2})
    args = families.get("qwen3_moe").args_from_config(config)
    bf16, out = tmp_path / "tiny-bf16.gguf", tmp_path / "tiny-Q4_K_M.gguf"
    tokens = (("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)], gguf.GGUFValueType.ARRAY,
               gguf.GGUFValueType.STRING),)
    gguf_export.write_gguf(bf16, family="qwen3_moe", config=config, args=args, dtype="bf16", tokenizer=tokens,
                           tensors=synthetic.generate(name, config, device=torch.device("cpu"), dtype=torch.bfloat16))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{suite_files.QUANT}")
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(bf16).encode(), str(out).encode(), params) == 0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors if "_exps" in t.name}
    assert types and set(types.values()) <= {"Q4_K", "Q6_K"} and types["blk.0.ffn_gate_exps.weight"] == "Q4_K"
    before, after = suite_files.gguf_sizes(bf16), suite_files.gguf_sizes(out)
    assert len(after["expert_bytes"]) == 2 and after["kv_bytes_per_token"] == before["kv_bytes_per_token"]
    assert sum(after["expert_bytes"]) <= suite_files.QUANT_OF_BF16 * sum(before["expert_bytes"])


def test_the_mxfp4_cells_run_gpt_oss_quantised_to_mxfp4_moe(stub_engines, monkeypatch):
    """The gpt-oss file its users download: both systems on the BF16 export quantised to MXFP4_MOE."""
    # mxfp4_for asks suite_files' quantised_for for the MXFP4_MOE file
    monkeypatch.setattr(suite_files, "quantised_for", lambda ctx, model, routing, qtype=suite_files.QUANT: stub_engines[
        "files"].append((model, routing, qtype)) or Path("mxfp4.gguf"))
    _cell("gpu-gpt-oss-20b-mxfp4-8gb").run(_ctx())
    assert stub_engines["files"] == [(suite_gpu.GPT_OSS, "random", "MXFP4_MOE")]
    spec = stub_engines["specs"][0]["config"]
    assert spec["model"] == "mxfp4.gguf" and spec["vram_budget_gb"] == 8.0
