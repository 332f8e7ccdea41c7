"""installer/install-linux.sh against a temporary HOME: what it places, what --uninstall removes.

The bundle here is a small folder of the bundle's shape (an executable `tandem` and `_internal/assets/`
with the real desktop entry and icons): the script only copies and links files, so this checks it in
a second; tests/installer/test_bundle.py installs the real bundle.
"""

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "installer" / "install-linux.sh"
SIZES = (16, 32, 48, 64, 128, 256, 512)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux installer")


def make_bundle(folder: Path) -> Path:
    assets = folder / "_internal" / "assets"
    shutil.copytree(ROOT / "assets" / "icons", assets / "icons")
    for name in ("tandem.svg", "tandem.desktop"):
        shutil.copy2(ROOT / "assets" / name, assets / name)
    exe = folder / "tandem"
    exe.write_text("#!/bin/sh\necho bundle-ran \"$@\"\n")
    exe.chmod(0o755)
    return folder


def run_script(home: Path, *args, **env_extra) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(HOME=str(home), **env_extra)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def tree(home: Path) -> set[str]:
    return {str(p.relative_to(home)) for p in home.rglob("*")}


def read_desktop(path: Path) -> dict:
    cp = configparser.ConfigParser(interpolation=None)
    cp.optionxform = str  # keys are case-sensitive
    cp.read(path)
    return dict(cp["Desktop Entry"])


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "home"
    h.mkdir()
    return h


def test_install_places_bundle_launcher_icons_and_link(tmp_path, home):
    bundle = make_bundle(tmp_path / "unpacked" / "tandem")
    p = run_script(home, "--bundle", str(bundle))
    assert p.returncode == 0, p.stderr
    lib = home / ".local/lib/tandem"
    share = home / ".local/share"
    assert (lib / "tandem").is_file() and os.access(lib / "tandem", os.X_OK)

    entry = read_desktop(share / "applications/tandem.desktop")
    assert entry["Exec"] == f'"{lib}/tandem" gui' and entry["TryExec"] == f"{lib}/tandem"
    assert entry["Icon"] == "tandem" and entry["Type"] == "Application" and entry["Terminal"] == "false"
    exec_argv = [entry["Exec"].split('"')[1], "gui"]  # what a desktop runs on double-click
    assert subprocess.run(exec_argv, capture_output=True, text=True).stdout.strip() == "bundle-ran gui"

    for n in SIZES:
        icon = share / f"icons/hicolor/{n}x{n}/apps/tandem.png"
        assert icon.read_bytes() == (ROOT / f"assets/icons/tandem-{n}.png").read_bytes()
    assert (share / "icons/hicolor/scalable/apps/tandem.svg").read_bytes() == (ROOT / "assets/tandem.svg").read_bytes()

    link = home / ".local/bin/tandem"
    assert link.is_symlink() and os.readlink(link) == str(lib / "tandem")
    manifest = (lib / "install-manifest.txt").read_text().split("\n")
    assert str(link) in manifest and str(share / "applications/tandem.desktop") in manifest


def test_uninstall_removes_exactly_what_was_placed(tmp_path, home):
    bundle = make_bundle(tmp_path / "tandem")
    # What the user had before: their chats, another app's launcher and icon, their own `tandem` command.
    data = home / ".local/share/tandem"
    data.mkdir(parents=True)
    (data / "chats.sqlite3").write_bytes(b"user chats")
    other = home / ".local/share/applications/other.desktop"
    other.parent.mkdir(parents=True)
    other.write_text("[Desktop Entry]\nName=Other\n")
    own_icon = home / ".local/share/icons/hicolor/48x48/apps/other.png"
    own_icon.parent.mkdir(parents=True)
    own_icon.write_bytes(b"png")
    user_cmd = home / ".local/bin/tandem"
    user_cmd.parent.mkdir(parents=True)
    user_cmd.write_text("#!/bin/sh\necho pip-installed\n")
    before = tree(home)

    p = run_script(home, "--bundle", str(bundle))
    assert p.returncode == 0, p.stderr
    assert "left as it is" in p.stdout and user_cmd.read_text().endswith("pip-installed\n")  # not replaced

    p = run_script(home, "--uninstall")
    assert p.returncode == 0, p.stderr
    after = tree(home)
    # Empty folders the install created (icon size folders, ~/.local/lib) may stay; no file may.
    leftover_files = {f for f in after - before if (home / f).is_file() or (home / f).is_symlink()}
    assert not leftover_files
    assert before <= after  # nothing of the user's is gone
    assert (data / "chats.sqlite3").read_bytes() == b"user chats" and user_cmd.is_file()
    assert not (home / ".local/lib/tandem").exists()

    p = run_script(home, "--uninstall")  # a second uninstall finds nothing and says so
    assert p.returncode == 0 and "not installed" in p.stdout


def test_reinstall_replaces_the_bundle_and_keeps_user_data(tmp_path, home):
    bundle = make_bundle(tmp_path / "tandem")
    assert run_script(home, "--bundle", str(bundle)).returncode == 0
    data = home / "xdg-data/tandem"
    data.mkdir(parents=True)
    (data / "chats.sqlite3").write_bytes(b"user chats")
    stale = home / ".local/lib/tandem/_internal/old-version-only.txt"
    stale.write_text("from the previous version")

    (bundle / "tandem").write_text("#!/bin/sh\necho new-version\n")
    p = run_script(home, "--bundle", str(bundle), XDG_DATA_HOME=str(home / "xdg-data"))
    assert p.returncode == 0, p.stderr
    assert not stale.exists()  # the old bundle was removed, not merged into
    assert subprocess.run([home / ".local/lib/tandem/tandem"], capture_output=True, text=True).stdout == "new-version\n"
    assert (home / "xdg-data/applications/tandem.desktop").is_file()  # XDG_DATA_HOME is honoured
    assert not (home / ".local/share/applications/tandem.desktop").exists()  # the old launcher went with it
    assert (data / "chats.sqlite3").read_bytes() == b"user chats"


def test_bad_bundle_is_refused_with_a_remedy(tmp_path, home):
    empty = tmp_path / "not-a-bundle"
    empty.mkdir()
    p = run_script(home, "--bundle", str(empty))
    assert p.returncode == 2
    assert "has no executable" in p.stderr and "what to do:" in p.stderr
    assert not (home / ".local").exists()
