"""`tandem calibrate` as a user runs it, and StatsSnapshot naming the profile in use."""

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import write_tiny_llama_gguf
from hwcheck import make_profile
from engine.api import Engine, EngineConfig
from engine.hw import profile

REPO = Path(__file__).resolve().parents[2]


def tandem(*args, data_dir: Path, timeout=180):
    env = {**os.environ, "TANDEM_DATA_DIR": str(data_dir), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def test_calibrate_prints_a_table_saves_the_profile_and_writes_json(tmp_path):
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out.json"
    p = tandem("calibrate", "--quick", "--model", str(gguf), "--json", str(out), data_dir=tmp_path / "data")
    assert p.returncode == 0, p.stderr
    assert "DRAM" in p.stdout and "A " in p.stdout and "saved to" in p.stdout
    assert "[100%] done" in p.stderr and "[" not in p.stdout.splitlines()[0]  # progress on stderr only
    written = json.loads(out.read_text())
    assert written == json.loads((tmp_path / "data" / "hw-profile.json").read_text())
    assert written["shapes"][written["calibrated_shape"]]["model"] == str(gguf)


def test_calibrate_bad_model_is_a_clear_error(tmp_path):
    p = tandem("calibrate", "--model", str(tmp_path / "missing.gguf"), data_dir=tmp_path / "data")
    assert p.returncode == 2 and "model not found" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "data" / "hw-profile.json").exists()


def test_stats_name_the_profile_in_use(tmp_path):
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    engine = Engine(EngineConfig(model=str(gguf), device="cpu", backend="tandem"))
    assert engine.stats().profile is None  # nothing calibrated yet
    engine.close()
    path = profile.save(make_profile(created="2026-02-03T04:05:06+00:00"), tmp_path / "mine.json")
    engine = Engine(EngineConfig(model=str(gguf), device="cpu", backend="tandem", profile_path=str(path)))
    named = engine.stats().profile
    assert str(path) in named and "2026-02-03T04:05:06" in named
    assert json.loads(engine.stats().to_json())["profile"] == named
    engine.close()
