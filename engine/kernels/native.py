"""The native CPU kernels (`engine._native`, built from `native/` by pip install), found or not.

Everything that calls them goes through here: `module()` is the extension or None (the reason is in
`load_error()`), and `threads()` is the thread count the CPU kernels use. The GPU-driving thread needs
a core of its own on a hybrid run, so the runtime sets `set_threads(cores - 1)` there.

Environment: TANDEM_NATIVE=0 hides the extension (torch fallbacks run); TANDEM_NATIVE_ISA pins an ISA
(`avx512bf16`, `avx512`, `avx2`, `scalar`); TANDEM_CPU_THREADS sets the default thread count.
"""

from __future__ import annotations

import importlib
import os
from functools import lru_cache

import torch

# The integer codes native/common.h gives its element types.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_threads: int | None = None
_load_error: str | None = None


@lru_cache(maxsize=1)
def module():
    """engine._native, or None when it is missing, fails to import or is disabled."""
    global _load_error
    if os.environ.get("TANDEM_NATIVE", "1") == "0":
        _load_error = "disabled by TANDEM_NATIVE=0"
        return None
    try:
        return importlib.import_module("engine._native")
    except ImportError as e:  # not built (no compiler at install time), or built for another Python
        _load_error = f"engine._native is not available ({e})"
        return None


def reload() -> None:
    """Forget the cached import (tests hide and restore the module)."""
    global _load_error
    _load_error = None
    module.cache_clear()


def load_error() -> str | None:
    module()
    return _load_error


def isa() -> str | None:
    """The instruction set the native kernels run with (None without the extension)."""
    m = module()
    return m.isa() if m is not None else None


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def set_threads(n: int | None) -> None:
    """Threads of every native CPU kernel call from now on; None: the default (TANDEM_CPU_THREADS,
    else all usable cores)."""
    global _threads
    if n is not None and n < 1:
        raise ValueError(f"thread count must be ≥ 1, got {n}")
    _threads = n


def threads_setting() -> int | None:
    """What set_threads was last given (None: the default), to put back later."""
    return _threads


def threads() -> int:
    global _threads
    if _threads is None:
        env = os.environ.get("TANDEM_CPU_THREADS")
        _threads = int(env) if env else available_cores()
    return _threads


_OPENMP_NAMES = ("libgomp", "libiomp", "libomp")


def openmp_runtimes() -> list[str]:
    """The OpenMP runtime files mapped into this process (Linux; [] elsewhere), one entry per file.

    torch's CPU wheels ship libgomp as libgomp.so.1, the soname the extension links, so one file is
    mapped; wheels that rename it (libgomp-<hash>.so.1) map the system's copy too. Mapped is not used:
    `openmp_runtime()` names the one the extension's thread teams come from."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "/" in line}
    except OSError:
        return []
    found = {os.path.realpath(p) for p in paths if os.path.basename(p).startswith(_OPENMP_NAMES)}
    return sorted(found)


def openmp_runtime() -> str | None:
    """The OpenMP runtime file the native kernels' calls bind to (torch's when torch was imported
    first, as this module does); None without the extension, "" where it cannot tell."""
    m = module()
    if m is None or not hasattr(m, "openmp_runtime"):
        return None
    path = m.openmp_runtime()
    return os.path.realpath(path) if path else ""
