"""The PyInstaller bundle, built on this machine by installer/build.py and run as a user would.

Every run below has a fresh HOME and XDG folders, no PYTHONPATH and a working directory outside the
checkout, so the bundle can only use what is inside it.
"""

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "installer" / "dist" / "tandem"
BUILD_TIMEOUT_S = 45 * 60

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux bundle and installer")]


@pytest.fixture(scope="module")
def bundle():
    pytest.importorskip("PyInstaller")
    p = subprocess.run([sys.executable, str(ROOT / "installer" / "build.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=BUILD_TIMEOUT_S)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert (BUNDLE / "tandem").is_file() and (BUNDLE / "install-linux.sh").is_file()
    return BUNDLE


def clean_env(home: Path, **extra) -> dict:
    """A user's environment: their own HOME and XDG folders, nothing pointing into the checkout."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("XDG_", "TANDEM_", "PYTHON", "QT_")) and k != "VIRTUAL_ENV"}
    env.update(HOME=str(home), XDG_DATA_HOME=str(home / "data"), XDG_CACHE_HOME=str(home / "cache"),
               XDG_CONFIG_HOME=str(home / "config"), **extra)
    return env


def bundle_files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_bundle_generates_with_the_builtin_model(bundle, tmp_path):
    stats = tmp_path / "stats.json"
    p = subprocess.run([bundle / "tandem", "generate", "--model", "builtin:smollm2-135m-moe", "--prompt",
                        "What is the capital of France?", "--max-new-tokens", "8", "--greedy", "--device", "cpu",
                        "--stats-json", str(stats)],
                       cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "Paris" in p.stdout
    snap = json.loads(stats.read_text())
    assert snap["speed"]["decode_tok_s"] > 0
    assert snap["model"]["experts"] == 8  # the upcycled MoE ran, expert path and all
    # The tokenizer cache went to the user's cache folder, not into the bundle.
    assert list((tmp_path / "cache" / "tandem").rglob("tokenizer_config.json"))


def test_bundle_runs_the_native_kernels_and_the_cli(bundle, tmp_path):
    # Every expert on the CPU (the hybrid path with the CPU standing in for the GPU): the bundled C++
    # extension serves them, and says which instruction set it picked.
    stats = tmp_path / "stats.json"
    p = subprocess.run([bundle / "tandem", "generate", "--prompt", "What is the capital of France?",
                        "--max-new-tokens", "8", "--greedy", "--simulate-hybrid", "--expert-policy", "cpu-only",
                        "--quiet", "--stats-json", str(stats)],
                       cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "Paris" in p.stdout
    assert json.loads(stats.read_text())["kernels"]["cpu_experts"].startswith("native-")

    p = subprocess.run([bundle / "tandem", "models"], cwd=tmp_path, env=clean_env(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "builtin:smollm2-135m-moe" in p.stdout
    p = subprocess.run([bundle / "tandem", "generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi"],
                       cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "what to do:" in p.stderr


def test_bundle_leaves_out_what_nothing_runs(bundle):
    internal = bundle / "_internal"
    for absent in ("scipy", "triton", "accelerate", "llama_cpp", "PySide6/Qt/translations", "torch/include",
                   "torch/test", "transformers/models/whisper"):
        assert not (internal / absent).exists(), absent
    assert [p.name for p in (internal / "torch" / "bin").iterdir()] == ["torch_shm_manager"]
    assert not list(internal.glob("accelerate-*.dist-info"))  # transformers would think accelerate is there
    size_mib = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file() and not p.is_symlink()) / 2**20
    assert size_mib < 1000, f"the CPU bundle grew to {size_mib:.0f} MiB (866 MiB measured; README)"


def test_bundle_serves_the_openai_api(bundle, tmp_path):
    """`tandem serve` from the bundle (FastAPI and uvicorn inside it) answers an authorised request."""
    import urllib.request

    from engine.server.launch import free_port, new_api_key

    key, port = new_api_key(), free_port()
    server = subprocess.Popen([bundle / "tandem", "serve", "--port", str(port), "--device", "cpu", "--quiet"],
                              cwd=tmp_path, env=clean_env(tmp_path, TANDEM_API_KEY=key), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                                         headers={"Authorization": f"Bearer {key}"})
        body, end = None, time.monotonic() + 300
        while body is None and time.monotonic() < end and server.poll() is None:
            try:
                with urllib.request.urlopen(request, timeout=5) as reply:
                    body = json.loads(reply.read())
            except OSError:
                time.sleep(0.5)
        assert body is not None, server.communicate(timeout=30)[1][-4000:] if server.poll() is not None else "no reply"
        assert [m["id"] for m in body["data"]] == ["builtin:smollm2-135m-moe"]
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def wait_for(check, timeout_s: float, proc: subprocess.Popen) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.25)
    return False


def test_first_launch_opens_the_wizard_and_keeps_data_in_the_user_folder(bundle, tmp_path):
    env = clean_env(tmp_path, QT_QPA_PLATFORM="offscreen")
    data = tmp_path / "data" / "tandem"  # platformdirs' user data folder under XDG_DATA_HOME
    before = bundle_files(bundle)
    app = subprocess.Popen([bundle / "tandem"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        started = wait_for(lambda: (data / "chats.sqlite3").is_file() and (data / "tandem.lock").is_file(), 120, app)
        assert started, app.communicate(timeout=30)[1][-4000:] if app.poll() is not None else "no data folder"
        time.sleep(5)
        assert app.poll() is None, app.communicate(timeout=30)[1][-4000:]  # still up: the wizard waits for the user

        with sqlite3.connect(data / "chats.sqlite3") as db:  # first launch: the wizard has not finished yet
            keys = {row[0] for row in db.execute("SELECT key FROM settings")}
        assert "wizard_done" not in keys

        # A second launch finds the first one holding this very folder and says so.
        second = subprocess.run([bundle / "tandem"], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=300)
        assert second.returncode == 3, second.stderr[-4000:]
        assert "already running" in second.stderr and str(data) in second.stderr
    finally:
        app.send_signal(signal.SIGTERM)
        try:
            app.wait(timeout=30)
        except subprocess.TimeoutExpired:
            app.kill()
            app.wait()
    assert bundle_files(bundle) == before  # nothing was written inside the bundle


X_PROBE = r"""
"$1" &
app=$!
for _ in $(seq 180); do
    sleep 0.5
    kill -0 $app 2>/dev/null || { echo "EXITED"; exit 1; }
    win=$(xwininfo -root -tree | grep '"Tandem setup"' | grep -o '^ *0x[0-9a-f]*' | head -1)
    if [ -n "$win" ]; then xprop -id $win WM_CLASS; kill $app; wait $app; exit 0; fi
done
echo "NO WIZARD WINDOW"; kill $app; exit 1
"""


@pytest.mark.skipif(not (shutil.which("xvfb-run") and shutil.which("xwininfo") and shutil.which("xprop")),
                    reason="needs xvfb-run, xwininfo and xprop")
def test_first_launch_on_an_x_server_shows_the_setup_wizard(bundle, tmp_path):
    """Under a real X server (the xcb platform plugin a desktop uses, not offscreen) the first launch
    opens the wizard's window, whose WM_CLASS is what tandem.desktop's StartupWMClass names."""
    p = subprocess.run(["xvfb-run", "-a", "-s", "-screen 0 1280x900x24", "bash", "-c", X_PROBE, "probe",
                        str(bundle / "tandem")], cwd=tmp_path, env=clean_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    desktop = (ROOT / "assets" / "tandem.desktop").read_text()
    wm_class = p.stdout.split("=", 1)[1].strip()  # WM_CLASS(STRING) = "tandem", "Tandem"
    assert f'"{desktop.split("StartupWMClass=")[1].split()[0]}"' in wm_class


def test_install_run_uninstall_reinstall_keeps_user_data(bundle, tmp_path):
    env = clean_env(tmp_path)
    p = subprocess.run(["bash", bundle / "install-linux.sh"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    installed = tmp_path / ".local" / "lib" / "tandem"
    desktop = (tmp_path / "data" / "applications" / "tandem.desktop").read_text()
    assert f'Exec="{installed}/tandem" gui' in desktop.splitlines()
    assert (tmp_path / "data" / "icons" / "hicolor" / "256x256" / "apps" / "tandem.png").is_file()

    run = subprocess.run([tmp_path / ".local" / "bin" / "tandem", "models"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # the link on PATH starts the installed copy
    assert run.returncode == 0 and "builtin:smollm2-135m-moe" in run.stdout, run.stderr

    user_data = tmp_path / "data" / "tandem"
    user_data.mkdir(parents=True, exist_ok=True)
    (user_data / "chats.sqlite3").write_bytes(b"the user's chats")
    p = subprocess.run(["bash", installed / "install-linux.sh", "--uninstall"], env=env, capture_output=True,
                       text=True, timeout=120)  # the installed copy of the script removes its own folder
    assert p.returncode == 0, p.stderr
    assert not installed.exists() and not (tmp_path / ".local" / "bin" / "tandem").is_symlink()
    assert not (tmp_path / "data" / "applications" / "tandem.desktop").exists()
    assert not list((tmp_path / "data" / "icons").rglob("tandem.*"))
    assert (user_data / "chats.sqlite3").read_bytes() == b"the user's chats"

    p = subprocess.run(["bash", bundle / "install-linux.sh"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and (installed / "tandem").is_file()
    assert (user_data / "chats.sqlite3").read_bytes() == b"the user's chats"
    shutil.rmtree(installed)  # 0.5+ GB: do not keep it in the temporary folder
