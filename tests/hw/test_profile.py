"""The profile on disk: atomic replacement, rejection of foreign profiles, and the accessors the
roofline and the expert planner read."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hwcheck import EXPERT, KV, make_profile, unexplained_nulls
from engine.api import load_profile
from engine.hw import profile
from engine.hw.probe import fingerprint, probe
from engine.hw.profile import KVCosts, MachineProfile, ProfileMismatchError
from engine.hw.shapes import ExpertShape, KVShape

REPO = Path(__file__).resolve().parents[2]
def saved(path: Path, **kw) -> Path:
    profile.write_atomic(path, json.dumps(make_profile(**kw)))
    return path


# -- atomic write ----------------------------------------------------------------------------------

def test_failed_replace_keeps_the_previous_profile(tmp_path, monkeypatch):
    path = saved(tmp_path / "hw-profile.json", A=1.0)

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(profile.ProfileError, match="disk full"):  # told as cause + remedy, not a raw OSError
        profile.save(make_profile(A=2.0), path)
    monkeypatch.undo()
    assert profile.load(path).kv_costs(KV).A_ns_per_token == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hw-profile.json"]  # no temp file left behind


def test_process_killed_between_write_and_rename_keeps_the_previous_profile(tmp_path):
    path = saved(tmp_path / "hw-profile.json", A=1.0)
    new = json.dumps(make_profile(A=2.0))
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from engine.hw import profile\n"
        "def killed(src, dst):\n"
        "    assert Path(src).read_text() == sys.argv[2]  # the new profile is fully written and synced\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "os.replace = killed\n"
        "profile.write_atomic(Path(sys.argv[1]), sys.argv[2])\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", code, str(path), new], cwd=REPO, env=env, capture_output=True, timeout=120)
    assert p.returncode == -9, p.stderr.decode()
    leftovers = [q for q in tmp_path.iterdir() if q.name != "hw-profile.json"]
    assert len(leftovers) == 1 and leftovers[0].read_text() == new  # the crash came after the write
    assert profile.load(path).kv_costs(KV).A_ns_per_token == 1.0  # … and the old file is untouched
    profile.save(make_profile(A=3.0), path)  # a later calibration still lands
    assert profile.load(path).kv_costs(KV).A_ns_per_token == 3.0


# -- rejection -------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("cpu_model", "Some Other CPU"), ("logical_cores", 4096),
                                          ("gpu_name", "NVIDIA Imaginary 9000"), ("torch", "1.0.0")])
def test_profile_of_another_machine_is_rejected_with_a_clear_message(tmp_path, caplog, field, value):
    data = make_profile()
    data["fingerprint"][field] = value
    path = tmp_path / "hw-profile.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileMismatchError) as e:
        profile.load(path, strict=True)
    assert field in e.value.what and repr(value) in e.value.what and "tandem calibrate" in e.value.remedy
    with caplog.at_level(logging.WARNING, logger="tandem.hw"):
        assert load_profile(str(path)) is None
    assert field in caplog.text


def test_profile_of_another_schema_version_is_rejected(tmp_path):
    data = make_profile()
    data["schema_version"] = profile.SCHEMA_VERSION + 1
    path = tmp_path / "hw-profile.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileMismatchError, match="version"):
        profile.load(path, strict=True)


def test_unreadable_profile_is_ignored_and_replaced_by_the_next_calibration(tmp_path):
    path = tmp_path / "hw-profile.json"
    path.write_text('{"schema": "tandem-hw-prof')  # cut short
    assert profile.load(path) is None
    with pytest.raises(profile.ProfileError):
        profile.load(path, strict=True)
    profile.save(make_profile(A=5.0), path)
    assert profile.load(path).kv_costs(KV).A_ns_per_token == 5.0


def test_no_profile_is_none_and_default_location_honours_the_env(private_data_dir):
    assert profile.default_path() == private_data_dir / "hw-profile.json"
    assert load_profile() is None
    profile.save(make_profile())
    assert load_profile()["fingerprint"] == fingerprint(probe())


# -- accessors -------------------------------------------------------------------------------------

def test_kv_costs_come_from_the_profile(tmp_path):
    for A, B in ((12.5, 3.25), (40.0, 7.0)):
        p = profile.load(saved(tmp_path / "hw-profile.json", A=A, B=B, c_cpu=0.02, c_gpu=0.35))
        costs = p.kv_costs(KV)
        A_, B_, delta = costs  # unpacks as the roofline's three inputs
        assert (A_, B_) == (A, B) and delta == pytest.approx(0.33)
        assert costs.source == "measured" and costs.batch == 1
        assert p.kv_costs(KV, batch=3).A_ns_per_token == 2 * A  # nearest measured batch size: 4


def test_kv_costs_of_an_uncalibrated_shape_scale_by_bytes_per_token():
    p = MachineProfile(make_profile(A=10.0, B=4.0))
    wide = KVShape(n_heads=32, n_kv_heads=8, head_dim=64, dtype="bfloat16")  # 4× the bytes per token
    costs = p.kv_costs(wide)
    assert (costs.A_ns_per_token, costs.B_ns_per_token) == (40.0, 16.0)
    assert costs.delta_ms == pytest.approx(0.33) and costs.source.startswith("scaled from")


def test_cpu_only_profile_has_no_B_or_delta():
    data = make_profile()
    batch = data["shapes"][data["calibrated_shape"]]["kv"]["by_batch"]["1"]
    batch.update(B_ns_per_token=None, C_gpu_ms=None, delta_ms=None)
    A, B, delta = MachineProfile(data).kv_costs(KV)
    assert A == 12.5 and B is None and delta is None


def test_expert_costs_come_from_the_profile():
    e = MachineProfile(make_profile()).expert_costs(EXPERT)
    assert (e.B_P_GBps, e.B_H_GBps, e.B_R_GBps, e.fill_ms) == (50.0, 30.0, 0.0, 0.2)
    assert e.cpu_ms(1) == 0.3 and e.cpu_ms(16) == 0.6 and e.cpu_ms(40) == pytest.approx(0.9)
    assert e.cpu_ms(128) == pytest.approx(2.0)  # beyond the table: the last slope continues
    assert e.gpu_ms(64) == 0.09 and e.concurrent["B_H_GBps"] == 20.0
    double = ExpertShape(hidden=512, ffn=128, dtype="bfloat16")
    scaled = MachineProfile(make_profile()).expert_costs(double)
    assert scaled.cpu_ms(1) == pytest.approx(0.6) and scaled.source.startswith("scaled from")


def test_the_expert_cost_model_takes_the_profiles_measurements():
    """costs_from_profile: the calibrated CPU kernel's weight rate (one token) and cost per token (the
    slope of its two largest counts), B_P, and B_H as B_P plus the CPU's rate beside fills."""
    import torch

    from engine.runtime.expert_placement import costs_from_profile

    m = costs_from_profile(MachineProfile(make_profile()), EXPERT.hidden, EXPERT.ffn, torch.bfloat16)
    assert m.expert_bytes == EXPERT.bytes_per_expert
    assert m.cpu_gbps == pytest.approx(EXPERT.bytes_per_expert / 0.3e6)  # bytes per ms / 1e6
    per_token_ms = (1.2 - 0.6) / (64 - 16)
    assert m.cpu_tflops == pytest.approx(6 * EXPERT.hidden * EXPERT.ffn / (per_token_ms * 1e9))
    assert (m.pcie_gbps, m.host_gbps) == (50.0, 70.0)
    # a shape not calibrated: times scaled by bytes, so the rates stay
    wide = costs_from_profile(MachineProfile(make_profile()), 2 * EXPERT.hidden, EXPERT.ffn, torch.bfloat16)
    assert wide.cpu_gbps == pytest.approx(m.cpu_gbps) and wide.expert_bytes == 2 * m.expert_bytes
    cpu_only = make_profile()
    cpu_only["shapes"][cpu_only["calibrated_shape"]]["experts"].update(B_P_GBps=None, concurrent=None)
    alone = costs_from_profile(MachineProfile(cpu_only), EXPERT.hidden, EXPERT.ffn, torch.bfloat16)
    default = type(m).from_shape(EXPERT.hidden, EXPERT.ffn, 2)
    assert (alone.pcie_gbps, alone.host_gbps) == (default.pcie_gbps, default.host_gbps)
    assert costs_from_profile(None, EXPERT.hidden, EXPERT.ffn, torch.bfloat16) is None
    no_experts = make_profile()
    del no_experts["shapes"][no_experts["calibrated_shape"]]["experts"]
    assert costs_from_profile(MachineProfile(no_experts), EXPERT.hidden, EXPERT.ffn, torch.bfloat16) is None
    # damaged numbers (a zero time, a negative bandwidth): the defaults, not a failed load
    for damage in ({"cpu_ms": [{"tokens": 1, "ms": 0.0}]}, {"B_P_GBps": -5.0}):
        bad = make_profile()
        bad["shapes"][bad["calibrated_shape"]]["experts"].update(damage)
        assert costs_from_profile(MachineProfile(bad), EXPERT.hidden, EXPERT.ffn, torch.bfloat16) is None


def test_a_saved_calibration_profile_round_trips_with_every_null_explained(tmp_path):
    data = make_profile()
    assert unexplained_nulls(data) == []
    path = profile.save(data, tmp_path / "x" / "hw-profile.json")
    assert profile.read(path) == data


def test_kvcosts_is_a_plain_triple():
    assert tuple(KVCosts(1.0, 2.0, 0.5)) == (1.0, 2.0, 0.5)
