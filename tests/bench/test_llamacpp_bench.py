"""llama-bench runner and llama.cpp build helper: command lines, the pruning rule, and parsing of a
real llama-bench JSON output (recorded from a CPU build of llama-cpp-python 0.3.36's llama.cpp on a
tiny Tandem export). With TANDEM_LLAMA_BENCH set to a llama-bench binary, a live run as well."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine.bench import llamacpp_bench, llamacpp_build

SAMPLE = Path(__file__).parent / "data" / "llama_bench_cpu_sample.json"


def test_command_line():
    cmd = llamacpp_bench.command("bin/llama-bench", "m.gguf", n_gpu_layers=99, override_tensor="exps=CPU",
                                 no_kv_offload=True, flash_attn=[0, 1], depth=[0, 8192], batch=2048, n_prompt=512,
                                 n_gen=128, reps=3, n_cpu_moe=None)
    assert cmd == ["bin/llama-bench", "-m", "m.gguf", "-o", "json", "-ngl", "99", "-ot", "exps=CPU", "-nkvo", "1",
                   "-fa", "0,1", "-d", "0,8192", "-b", "2048", "-p", "512", "-n", "128", "-r", "3"]
    with pytest.raises(ValueError, match="unknown llama-bench flag"):
        llamacpp_bench.command("b", "m", gpu=1)


def test_parse_real_output():
    rows = llamacpp_bench.parse(SAMPLE.read_text())
    raw = json.loads(SAMPLE.read_text())
    assert len(rows) == len(raw) >= 2
    assert {r["test"] for r in rows} >= {"pp16", "tg8"}
    for r, src in zip(rows, raw):
        assert r["tok_s"] == src["avg_ts"] > 0 and len(r["samples_tok_s"]) == 2
        assert r["n_depth"] == src["n_depth"] and r["model_n_params"] == src["model_n_params"]
    assert {r["n_depth"] for r in rows} == {0, 16}


def test_record_keeps_the_command_and_build():
    cmd = llamacpp_bench.command("llama-bench", "tiny.gguf", n_prompt=16, n_gen=8, depth=[0, 16], reps=2)
    rec = llamacpp_bench.record(cmd, "log line before the JSON\n" + SAMPLE.read_text(), note="sample")
    assert rec["llama_bench_command"] == "llama-bench -m tiny.gguf -o json -p 16 -n 8 -d 0,16 -r 2"
    assert rec["llama_cpp"]["build_commit"] and rec["bench"] == "llamacpp" and rec["note"] == "sample"
    assert "machine" in rec and len(rec["results"]) == len(json.loads(SAMPLE.read_text()))


@pytest.mark.parametrize("member, kept", [
    ("llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt", "CMakeLists.txt"),
    ("llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml.c", "ggml/src/ggml.c"),
    ("llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml-cuda/mmq.cu", "ggml/src/ggml-cuda/mmq.cu"),
    ("llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp", None),
    ("llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf", None),
    ("llama_cpp_python-0.3.36/vendor/llama.cpp/tools/llama-bench/llama-bench.cpp", "tools/llama-bench/llama-bench.cpp"),
    ("llama_cpp_python-0.3.36/vendor/llama.cpp/tools/ui/index.html", None),
    ("llama_cpp_python-0.3.36/llama_cpp/llama.py", None),
    ("llama.cpp/src/llama.cpp", "src/llama.cpp"),  # a pruned tarball re-pruned: unchanged
])
def test_prune_rule(member, kept):
    assert llamacpp_build._relative(member) == kept


def test_cmake_arguments():
    cpu = llamacpp_build.cmake_args(Path("s"), Path("b"), cuda=False, cuda_arch="90")
    assert "-DCMAKE_BUILD_TYPE=Release" in cpu and "-G" in cpu and not any("CUDA" in a for a in cpu)
    assert "-DLLAMA_BUILD_TESTS=OFF" in cpu and "-DLLAMA_BUILD_SERVER=OFF" in cpu


@pytest.mark.skipif(not os.environ.get("TANDEM_LLAMA_BENCH"), reason="set TANDEM_LLAMA_BENCH to a llama-bench binary")
def test_live_run(tmp_path):
    """llama-bench on a tiny export: two depths, one row per test and depth."""
    from test_gguf_export import _tiny_folder

    from engine.bench import gguf_export

    gguf = tmp_path / "t.gguf"
    gguf_export.export(str(_tiny_folder(tmp_path / "m")), gguf)
    rec = llamacpp_bench.run(os.environ["TANDEM_LLAMA_BENCH"], gguf, n_prompt=16, n_gen=8, depth=[0, 16], reps=2,
                             timeout=300)
    assert sorted((r["test"], r["n_depth"]) for r in rec["results"]) == [("pp16", 0), ("pp16", 16),
                                                                         ("tg8", 0), ("tg8", 16)]
    assert all(r["tok_s"] > 0 for r in rec["results"])


def test_unpack_prunes_and_keeps_the_tree_for_the_same_tarball(tmp_path):
    import tarfile

    src = tmp_path / "src" / "pkg" / "vendor" / "llama.cpp"
    for rel in ("CMakeLists.txt", "src/llama.cpp", "models/big.gguf", "ggml/src/ggml-metal/x.m", "ggml/src/ggml.c"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    tarball = tmp_path / "pkg.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(tmp_path / "src" / "pkg", arcname="pkg")
    root = llamacpp_build.unpack(tarball, tmp_path / "b")
    kept = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert kept == ["CMakeLists.txt", "ggml/src/ggml.c", "src/llama.cpp"]
    before = (root / "src/llama.cpp").stat().st_mtime_ns
    assert llamacpp_build.unpack(tarball, tmp_path / "b") == root
    assert (root / "src/llama.cpp").stat().st_mtime_ns == before  # ninja sees nothing new: a rerun resumes
