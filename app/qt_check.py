"""Before Qt starts: are the system libraries of its X11 (xcb) platform plugin installed?

Qt 6 on X11 needs a few xcb libraries that a fresh desktop install often lacks (libxcb-cursor0,
libxcb-icccm4, libxcb-keysyms1, …). Without them Qt aborts with "could not load the Qt platform
plugin xcb … reinstalling the application may fix this problem", which sends people the wrong way.
So the app asks the dynamic loader first (`ldd` on the plugin: exactly the libraries this Qt build
links, resolved the way Qt would resolve them) and, when one is missing, names the package to install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# The Qt platforms that need no system display libraries, and those that do not use xcb at all.
NO_XCB_PLATFORMS = ("offscreen", "minimal", "vnc", "wayland", "eglfs", "linuxfb", "vkkhrdisplay")

# Debian/Ubuntu names of the libraries Qt's xcb plugin is known to need; any other soname is mapped
# by Debian's naming rule for library packages (libfoo-bar.so.1 → libfoo-bar1, libfoo-x11.so.0 → libfoo-x11-0).
KNOWN_PACKAGES = {
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-xinerama.so.0": "libxcb-xinerama0",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1",
    "libfontconfig.so.1": "libfontconfig1",
    "libdbus-1.so.3": "libdbus-1-3",
}


def debian_package(soname: str) -> str:
    """The Debian/Ubuntu package that ships `soname`."""
    if soname in KNOWN_PACKAGES:
        return KNOWN_PACKAGES[soname]
    m = re.fullmatch(r"(lib[\w.+-]+?)\.so\.(\d+)(?:\..*)?", soname)
    if not m:
        return soname
    name, major = m.group(1).lower(), m.group(2)
    return f"{name}-{major}" if name[-1].isdigit() else f"{name}{major}"


def missing_from_ldd(output: str) -> list[str]:
    """Sonames that `ldd` reports as `not found`, in its order, each once."""
    out: list[str] = []
    for line in output.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+not found", line)
        if m and m.group(1) not in out:
            out.append(m.group(1))
    return out


def uses_xcb(env: dict | None = None, platform: str | None = None) -> bool:
    """Whether Qt will pick its xcb plugin here (Linux, not told otherwise, no Wayland session)."""
    env = os.environ if env is None else env
    if (platform or sys.platform) != "linux":
        return False
    chosen = (env.get("QT_QPA_PLATFORM") or "").split(":")[0].split(";")[0].strip().lower()
    if chosen:
        return chosen == "xcb"
    return not env.get("WAYLAND_DISPLAY")  # Qt 6 prefers Wayland when a Wayland session is running


def xcb_plugin() -> Path | None:
    try:
        import PySide6
    except ImportError:
        return None
    path = Path(PySide6.__file__).resolve().parent / "Qt" / "plugins" / "platforms" / "libqxcb.so"
    return path if path.is_file() else None


def missing_qt_libraries() -> list[str]:
    """Sonames the xcb plugin needs that the loader cannot find ([] when all are there or it cannot tell)."""
    plugin, ldd = xcb_plugin(), shutil.which("ldd")
    if plugin is None or ldd is None:
        return []
    # Where this Qt's own libraries are (and, in a desktop bundle, everything it carries): ldd runs in a
    # process of its own, so it is told the folders the app's process loads from.
    extra = [str(plugin.parents[2] / "lib")] + ([getattr(sys, "_MEIPASS")] if hasattr(sys, "_MEIPASS") else [])
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(extra + [os.environ.get("LD_LIBRARY_PATH", "")]))
    try:
        run = subprocess.run([ldd, str(plugin)], capture_output=True, text=True, timeout=20, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [name for name in missing_from_ldd(run.stdout) if not _loadable(name)]


def _loadable(soname: str) -> bool:
    """Whether this process can load `soname` after all (a library it already holds counts)."""
    import ctypes

    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def describe_missing(sonames: list[str]) -> tuple[str, str]:
    """(what, remedy) for the start-up message: the libraries and the exact packages."""
    packages = " ".join(dict.fromkeys(debian_package(s) for s in sonames))
    what = ("Qt cannot open a window on this X11 desktop: its xcb platform plugin needs "
            f"{', '.join(sonames)}, which {'is' if len(sonames) == 1 else 'are'} not installed")
    remedy = (f"install the system package{'s' if len(sonames) > 1 else ''} (Debian/Ubuntu): "
              f"sudo apt-get install {packages}; then start Tandem again")
    return what, remedy


def check_qt_platform() -> tuple[str, str] | None:
    """None when Qt can start here; else (what, remedy) naming the packages to install."""
    if not uses_xcb():
        return None
    missing = missing_qt_libraries()
    return describe_missing(missing) if missing else None
