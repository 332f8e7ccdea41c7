"""The setup wizard: what the engine reports about the machine, calibration, model and memory."""

import json
from pathlib import Path

import pytest
from PySide6.QtCore import QRect
from PySide6.QtWidgets import QWizard

import engine.api
from app.main_window import engine_config
from app.hardware_words import machine_rows, no_gpu_reason, profile_line
from app.wizard import CALIBRATION, DONE, HARDWARE, MODEL, SetupWizard
from app.wizard_common import Details


def _open(qtbot, current, start=HARDWARE):
    wiz = SetupWizard(current, start)
    qtbot.addWidget(wiz)
    wiz.show()
    qtbot.waitUntil(lambda: wiz.facts is not None, timeout=60_000)
    return wiz


def test_wizard_walks_from_hardware_to_chat(qtbot):
    wiz = _open(qtbot, {"model": "builtin:smollm2-135m-moe"})
    hw = wiz.page(HARDWARE)
    # The machine in words, from what the engine reported (free memory changes between probes: compare
    # the page with the probe it showed, and that probe's stable parts with a fresh one).
    shown = wiz.facts["probe"]
    assert [(k, v.text()) for k, v in hw.rows.items()] == machine_rows(shown)
    fresh = engine.api.probe_hardware()
    # (torch's thread count is a setting, not the machine: a CPU engine's decode steps choose it)
    cpu = {k: v for k, v in shown["cpu"].items() if k != "torch_threads"}
    assert set(shown) == set(fresh) and cpu == {k: v for k, v in fresh["cpu"].items() if k != "torch_threads"}
    assert shown["gpu"] == fresh["gpu"]
    page_text = " ".join(v.text() for v in hw.rows.values()) + hw.note.text()
    assert "dram_total_bytes" not in page_text and "NVML" not in page_text  # no internal keys up front
    if not shown["gpu"].get("name"):  # no GPU: said once, with what it means
        assert hw.rows["GPU"].text() == "No usable GPU" and "runs on the CPU" in hw.note.text()
    assert not hw.details.body.isVisible()
    hw.details.toggle.click()  # the exact record is one click away
    assert hw.details.body.isVisible() and "dram_total_bytes" in hw.details.body.toPlainText()
    assert hw.isComplete()
    wiz.next()
    assert wiz.currentId() == CALIBRATION
    cal = wiz.page(CALIBRATION)
    if not hasattr(engine.api, "calibrate"):
        assert not cal.run_btn.isEnabled() and cal.skip.isChecked()
    cal.skip.setChecked(True)
    assert cal.isComplete()
    wiz.next()
    assert wiz.currentId() == MODEL
    page = wiz.model_page
    assert set(page.radios) == {m["name"] for m in engine.api.builtin_models()}
    assert page.radios["builtin:smollm2-135m-moe"].isChecked()
    assert "8 identical experts" in page.descriptions["builtin:smollm2-135m-moe"].text()
    page.ctx.setValue(4096)
    page.threads.setValue(2)
    wiz.next()
    assert wiz.currentId() == DONE
    assert "builtin:smollm2-135m-moe" in wiz.page(DONE).summary.text()
    assert wiz.values() == {"model": "builtin:smollm2-135m-moe", "vram_budget_gb": None, "max_context": 4096,
                            "cpu_threads": 2}
    wiz.button(QWizard.WizardButton.FinishButton).click()
    assert wiz.result() == QWizard.DialogCode.Accepted


def test_settings_reopen_the_model_page_and_apply(qtbot, open_window, tmp_path):
    w = open_window()
    local = tmp_path / "model.gguf"
    wiz = _open(qtbot, {"model": str(local)}, start=MODEL)
    assert wiz.currentId() == MODEL
    assert wiz.model_page.local_radio.isChecked() and wiz.model_page.path.text() == str(local)
    wiz.model_page.radios["builtin:smollm2-135m-moe"].setChecked(True)
    values = wiz.values()
    assert values["model"] == "builtin:smollm2-135m-moe"
    w.apply_setup(values)  # same model as loaded: saved, no reload
    assert w.store.setting("wizard_done") is True
    assert engine_config(w.store) == {"model": "builtin:smollm2-135m-moe"}
    assert w.host.state == "ready"


@pytest.fixture
def isolated_profile_dirs(tmp_path, monkeypatch):
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))


def test_wizard_calibrates_in_quick_mode(qtbot, isolated_profile_dirs):
    if not hasattr(engine.api, "calibrate"):
        pytest.skip("engine.api.calibrate is not in this build yet (it lands with the calibration branch)")
    wiz = _open(qtbot, {}, start=CALIBRATION)
    cal = wiz.page(CALIBRATION)
    assert cal.run_btn.isEnabled() and not cal.isComplete()
    cal.run_btn.click()
    assert cal.cancel_btn.isEnabled() and not cal.isComplete()
    qtbot.waitUntil(lambda: cal.result is not None or not cal.busy(), timeout=180_000)
    assert cal.result is not None, cal.step.text()
    assert cal.bar.value() == 1000 and cal.isComplete()
    assert wiz.facts["profile"] == cal.result
    assert engine.api.load_profile() == cal.result  # written where the engine reads it


def test_wizard_calibration_cancel_keeps_the_old_profile(qtbot, isolated_profile_dirs):
    if not hasattr(engine.api, "calibrate"):
        pytest.skip("engine.api.calibrate is not in this build yet (it lands with the calibration branch)")
    before = engine.api.load_profile()
    wiz = _open(qtbot, {}, start=CALIBRATION)
    cal = wiz.page(CALIBRATION)
    cal.run_btn.click()
    cal.cancel()
    qtbot.waitUntil(lambda: not cal.busy(), timeout=180_000)
    assert cal.result is None and "Stopped" in cal.step.text()
    assert engine.api.load_profile() == before


# A real GPU machine's probe, as the engine recorded it in a calibration profile (H200 host, 2026-12-01).
H200_PROBE = json.loads((Path(__file__).resolve().parent / "data" / "h200-profile.json").read_text())


def test_hardware_and_profile_in_words():
    machine = H200_PROBE["machine"]
    rows = dict(machine_rows(machine))
    assert rows["GPU"] == "NVIDIA H200 · 140 GB · PCIe 5.0 ×16"
    assert rows["Memory"].endswith("RAM") or " RAM (" in rows["Memory"]
    assert "cores" in rows["CPU"] and ("AVX" in rows["CPU"] or "AMX" in rows["CPU"])
    assert no_gpu_reason(machine) is None
    line = profile_line(H200_PROBE)
    assert line.startswith("PCIe 54 GB/s · RAM ") and "saved" in line
    cpu_only = {"gpu": {"name": None, "unavailable": {"name": "this torch build has no CUDA support"}},
                "memory": {"dram_total_bytes": 64 * 2**30, "dram_available_bytes": 60 * 2**30},
                "cpu": {"model": "AMD Ryzen 9", "physical_cores": 16, "logical_cores": 32,
                        "isa": {"avx2": True, "avx512": True, "avx512_bf16": False, "amx": False}}}
    assert machine_rows(cpu_only)[:3] == [("GPU", "No usable GPU"), ("Memory", "64 GB RAM (60 GB free)"),
                                          ("CPU", "AMD Ryzen 9 · 16 cores (32 threads), AVX-512")]
    assert no_gpu_reason(cpu_only).startswith("This PyTorch build has no CUDA support, so the model runs on the CPU")


def _buttons_inside(wiz):
    shown = [wiz.button(b) for b in (QWizard.WizardButton.BackButton, QWizard.WizardButton.NextButton,
                                     QWizard.WizardButton.CancelButton, QWizard.WizardButton.FinishButton)]
    shown = [b for b in shown if b.isVisible()]
    assert shown
    for b in shown:
        top_left = b.mapTo(wiz, b.rect().topLeft())
        assert wiz.rect().contains(QRect(top_left, b.size())), (b.text(), top_left, wiz.size())
    return shown


@pytest.mark.parametrize("page_id", [HARDWARE, CALIBRATION, MODEL, DONE])
def test_every_page_fits_1280x720_with_its_buttons(qtbot, page_id):
    wiz = _open(qtbot, {"model": "builtin:smollm2-135m-moe"}, start=page_id)
    wiz.facts["profile"] = H200_PROBE  # the longest record a page shows
    wiz.restart()
    qtbot.wait(50)
    page = wiz.currentPage()
    for details in page.findChildren(Details):
        if details.isVisibleTo(page):
            details.toggle.setChecked(True)  # opened, it must still fit
    qtbot.wait(50)
    hint = wiz.minimumSizeHint()
    assert hint.width() <= 1280 and hint.height() <= 720 - 40, hint  # 40 px: title bar and a panel
    assert wiz.width() <= 1280 and wiz.height() <= 720 - 40, wiz.size()
    _buttons_inside(wiz)


def test_next_is_enabled_when_a_valid_profile_exists(qtbot):
    wiz = _open(qtbot, {}, start=CALIBRATION)
    cal = wiz.page(CALIBRATION)
    wiz.facts["profile"] = None
    cal.initializePage()
    assert not cal.isComplete() and cal.skip.isVisible()
    wiz.facts["profile"] = H200_PROBE  # a profile the engine accepted (load_profile returned it)
    cal.initializePage()
    assert cal.isComplete() and wiz.button(QWizard.WizardButton.NextButton).isEnabled()
    assert not cal.skip.isVisible()
    assert cal.current.text() == f"<b>{profile_line(H200_PROBE)}</b>"
    assert "read_GBps" in cal.details.body.toPlainText()  # the measured table, behind Details
