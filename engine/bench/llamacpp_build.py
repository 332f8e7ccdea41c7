"""Build llama.cpp's `llama-bench` from the llama.cpp sources vendored in the llama-cpp-python sdist.

    python -m engine.bench.llamacpp_build --source llama_cpp_python-0.3.36.tar.gz --prune llamacpp-src.tar.gz
    python -m engine.bench.llamacpp_build --source llamacpp-src.tar.gz --build-dir build-llamacpp

`--prune` writes a minimal source tarball (what the build reads, no models, docs, tests, web UI or
foreign GPU backends): small enough to carry to a machine without network. `--source` takes the sdist,
such a pruned tarball, or an unpacked llama.cpp folder. The build is CMake + ninja, Release, static,
only the requested targets (default `llama-bench`; the suite's GPU cells add `llama-batched-bench`, and
`llama-quantize` to make their Q4_K_M files the way llama.cpp's users do), with CUDA (`-DGGML_CUDA=ON`, architectures
`--cuda-arch`, default 90 = H100/H200) when `nvcc` is found and `--cpu` is not given, CPU only
otherwise. GGML_NATIVE stays on: the binary is built on the machine that runs it. A CUDA toolkit
without cuBLAS (nvcc and cudart only) is completed by the pip cuBLAS of the same CUDA major that
torch's CUDA wheels install (found on sys.path, or `--cublas-dir SITE_PACKAGES`).

A build stopped part-way resumes where it stopped when run again with the same --build-dir (ninja
rebuilds only what is missing; the unpacked sources are kept while the tarball is the same one).

Only the standard library is used: this runs before (and apart from) Tandem's dependencies.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

# Top-level entries of llama.cpp a build of its tools reads. tools/ is kept whole except the server
# and its web UI (configured only with LLAMA_BUILD_SERVER): CMake configures every tool folder.
KEEP_TOP = {"CMakeLists.txt", "LICENSE", "cmake", "include", "src", "common", "vendor", "licenses", "ggml", "tools"}
DROP = {"tools/ui", "tools/server", "tools/cli"}  # cli is configured only with LLAMA_BUILD_SERVER, too
GGML_BACKENDS_KEPT = {"ggml-cpu", "ggml-cuda"}  # other ggml/src/ggml-* folders are configured only when enabled


def _relative(member: str) -> str | None:
    """The path inside llama.cpp of a tarball member, or None when the build does not need it.
    Members sit under `<sdist>/vendor/llama.cpp/` (sdist) or `llama.cpp/` (pruned tarball)."""
    parts = member.split("/")
    for i in range(len(parts)):
        if parts[i] == "llama.cpp":
            rel = parts[i + 1:]
            break
    else:
        return None
    if not rel or rel[0] not in KEEP_TOP:
        return None
    path = "/".join(rel)
    if any(path == d or path.startswith(d + "/") for d in DROP):
        return None
    if rel[:2] == ["ggml", "src"] and len(rel) > 3 and rel[2].startswith("ggml-") and rel[2] not in GGML_BACKENDS_KEPT:
        return None  # a backend folder (a file directly under ggml/src has len(rel) == 3)
    return path


def unpack(source: Path, dest: Path) -> Path:
    """The llama.cpp tree of `source` (tarball or folder) under dest/llama.cpp, pruned."""
    if source.is_dir():
        return source
    root = dest / "llama.cpp"
    stamp = dest / "llama.cpp.source"  # which tarball the tree came from: same one, tree kept (mtimes too)
    identity = f"{source.resolve()} {source.stat().st_size} {source.stat().st_mtime_ns}"
    if root.is_dir() and stamp.is_file() and stamp.read_text() == identity:
        return root
    if root.exists():
        shutil.rmtree(root)
    with tarfile.open(source) as tar:
        for m in tar.getmembers():
            rel = _relative(m.name)
            if rel is None or not (m.isfile() or m.isdir()):
                continue
            target = root / rel
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(m) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.chmod(target, m.mode & 0o755 | 0o644)
    if not (root / "CMakeLists.txt").is_file():
        raise SystemExit(f"{source} holds no llama.cpp sources (expected …/llama.cpp/CMakeLists.txt)")
    stamp.write_text(identity)
    return root


def prune(source: Path, out: Path) -> dict:
    """Write the minimal llama.cpp source tarball (`llama.cpp/…`, xz) and say what it holds."""
    tmp = out.parent / (out.name + ".d")
    root = unpack(source, tmp)
    with tarfile.open(out, "w:xz") as tar:
        tar.add(root, arcname="llama.cpp")
    sizes = {}
    for top in sorted(root.iterdir()):
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()]
        sizes[top.name] = sum(p.stat().st_size for p in files)
    if tmp.exists():
        shutil.rmtree(tmp)
    return {"tarball": str(out), "bytes": out.stat().st_size, "unpacked_bytes_by_entry": sizes}


def nvcc_major() -> int | None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    for word in text.replace(",", " ").split():
        if word.startswith("V") and word[1:2].isdigit():  # "V13.0.88"
            return int(word[1:].split(".")[0])
    return None


def toolkit_has_cublas() -> bool:
    nvcc = shutil.which("nvcc")
    root = Path(nvcc).resolve().parent.parent if nvcc else None
    return bool(root) and any(root.glob("**/libcublas.so*")) and any(root.glob("**/cublas_v2.h"))


def pip_cublas(major: int, extra: list[Path] = ()) -> tuple[Path, Path] | None:
    """(include dir, lib dir) of a pip-installed cuBLAS of CUDA `major` (torch's CUDA wheels bring one:
    nvidia/cu13/… for CUDA 13, nvidia/cublas/… for CUDA 12), or None."""
    import site

    roots = [*extra, *(Path(p) for p in sys.path if p), *(Path(p) for p in site.getsitepackages())]
    for root in roots:
        for sub in (f"nvidia/cu{major}", "nvidia/cublas"):
            lib, inc = root / sub / "lib", root / sub / "include"
            if (lib / f"libcublas.so.{major}").is_file() and (inc / "cublas_v2.h").is_file():
                return inc, lib
    return None


def any_pip_cublas(extra: list[Path] = ()) -> tuple[Path, Path, str] | None:
    """A pip cuBLAS of any CUDA major: (include, lib, the library's file name)."""
    import site

    for root in [*extra, *(Path(p) for p in sys.path if p), *(Path(p) for p in site.getsitepackages())]:
        for lib in sorted(root.glob("nvidia/*/lib")):
            inc = lib.parent / "include"
            libs = sorted(lib.glob("libcublas.so.*"))
            if libs and (inc / "cublas_v2.h").is_file():
                return inc, lib, libs[0].name
    return None


def cublas_args(major: int | None, cublas_dir: Path | None) -> list[str]:
    """CMake hints to a cuBLAS outside the CUDA toolkit (a toolkit of nvcc and cudart only): the
    libraries by path, the headers on the include path, and an rpath so the binary finds them."""
    if major is None or (cublas_dir is None and toolkit_has_cublas()):
        return []
    extra = [cublas_dir] if cublas_dir else []
    found = pip_cublas(major, extra)
    if found is not None:
        inc, lib = found
        name = f"libcublas.so.{major}"
    elif (other := any_pip_cublas(extra)) is not None:
        inc, lib, name = other  # cuBLAS talks to the driver itself; a neighbouring major usually links and runs
        print(f"warning: no cuBLAS of CUDA {major}; using {lib / name} (another CUDA major)", file=sys.stderr)
    else:
        raise SystemExit(f"the CUDA {major} toolkit has no cuBLAS and no pip cuBLAS was found: "
                         f"install nvidia-cublas (CUDA {major}) or pass --cublas-dir SITE_PACKAGES, or build with --cpu")
    lt = name.replace("libcublas", "libcublasLt")
    return [f"-DCUDA_cublas_LIBRARY={lib}/{name}", f"-DCUDA_cublasLt_LIBRARY={lib}/{lt}",
            f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}", f"-DCMAKE_C_FLAGS=-I{inc}",
            f"-DCMAKE_BUILD_RPATH={lib}", f"-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath,{lib}"]


def driver_args() -> list[str]:
    """ggml-cuda links the driver library (libcuda) for its virtual-memory pool. A toolkit without the
    stub libcuda.so is pointed at the installed driver's libcuda.so.1; without either, the pool falls
    back to plain cudaMalloc (GGML_CUDA_NO_VMM)."""
    nvcc = shutil.which("nvcc")
    root = Path(nvcc).resolve().parent.parent if nvcc else None
    if root and any(root.glob("**/stubs/libcuda.so")):
        return []
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout if shutil.which("ldconfig") else ""
    candidates = [line.split("=>")[-1].strip() for line in listing.splitlines() if "libcuda.so.1 " in line]
    candidates += ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1", "/usr/lib/wsl/lib/libcuda.so.1"]
    for c in candidates:
        if Path(c).is_file():
            return [f"-DCUDA_cuda_driver_LIBRARY={c}"]
    return ["-DGGML_CUDA_NO_VMM=ON"]


def cmake_args(src: Path, build: Path, *, cuda: bool, cuda_arch: str, cublas_dir: Path | None = None) -> list[str]:
    args = ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON"]
    if cuda:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}", *cublas_args(nvcc_major(), cublas_dir),
                 *driver_args()]
    return args


def build(source: Path, build_dir: Path, *, targets=("llama-bench",), cpu: bool = False, cuda_arch: str = "90",
          jobs: int | None = None, cublas_dir: Path | None = None, configure_only: bool = False) -> dict:
    build_dir.mkdir(parents=True, exist_ok=True)
    src = unpack(source, build_dir)
    cuda = not cpu and shutil.which("nvcc") is not None
    out = build_dir / ("build-cuda" if cuda else "build-cpu")
    t0 = time.perf_counter()
    configure = cmake_args(src, out, cuda=cuda, cuda_arch=cuda_arch, cublas_dir=cublas_dir)
    subprocess.run(configure, check=True)
    if configure_only:
        return {"build_dir": str(out), "cuda": cuda, "configure": configure}
    compile_cmd = ["cmake", "--build", str(out), "--config", "Release", "-j", str(jobs or os.cpu_count() or 1),
                   "--target", *targets]
    subprocess.run(compile_cmd, check=True)
    binaries = {t: str(out / "bin" / t) for t in targets}
    for path in binaries.values():
        if not Path(path).is_file():
            raise SystemExit(f"the build finished but {path} is missing")
    return {"binaries": binaries, "cuda": cuda, "seconds": round(time.perf_counter() - t0, 1),
            "configure": configure, "build": compile_cmd}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.llamacpp_build", description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True, type=Path,
                   help="llama-cpp-python sdist (.tar.gz), a pruned tarball, or a llama.cpp folder")
    p.add_argument("--prune", type=Path, default=None, help="only write a minimal source tarball here")
    p.add_argument("--build-dir", type=Path, default=Path("build-llamacpp"))
    p.add_argument("--targets", default="llama-bench",
                   help="comma-separated CMake targets (e.g. llama-bench,llama-batched-bench,llama-quantize)")
    p.add_argument("--cpu", action="store_true", help="CPU only, even where nvcc exists")
    p.add_argument("--cuda-arch", default="90", help="CMAKE_CUDA_ARCHITECTURES (90: Hopper)")
    p.add_argument("-j", "--jobs", type=int, default=None)
    p.add_argument("--cublas-dir", type=Path, default=None,
                   help="a site-packages holding pip's nvidia cuBLAS, for a CUDA toolkit without cuBLAS "
                   "(default: searched on sys.path)")
    p.add_argument("--configure-only", action="store_true", help="run CMake's configure step only")
    ns = p.parse_args(argv)
    import json

    if ns.prune:
        print(json.dumps(prune(ns.source, ns.prune), indent=2))
        return 0
    result = build(ns.source, ns.build_dir, targets=tuple(ns.targets.split(",")), cpu=ns.cpu,
                   cuda_arch=ns.cuda_arch, jobs=ns.jobs, cublas_dir=ns.cublas_dir, configure_only=ns.configure_only)
    print(json.dumps(result, indent=2))
    for path in result.get("binaries", {}).values():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
