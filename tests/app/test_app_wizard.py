"""The setup wizard: what the engine reports about the machine, calibration, model and memory."""

import pytest
from PySide6.QtWidgets import QWizard

import engine.api
from app.main_window import engine_config
from app.wizard import CALIBRATION, DONE, HARDWARE, MODEL, SetupWizard, facts_html


def _open(qtbot, current, start=HARDWARE):
    wiz = SetupWizard(current, start)
    qtbot.addWidget(wiz)
    wiz.show()
    qtbot.waitUntil(lambda: wiz.facts is not None, timeout=60_000)
    return wiz


def test_wizard_walks_from_hardware_to_chat(qtbot):
    wiz = _open(qtbot, {"model": "builtin:smollm2-135m-moe"})
    hw = wiz.page(HARDWARE)
    # what the engine reports, shown as reported (free memory changes between probes: compare the
    # page with the probe it showed, and that probe's stable parts with a fresh one)
    shown = wiz.facts["probe"]
    assert hw.text.text() == facts_html(shown)
    fresh = engine.api.probe_hardware()
    assert set(shown) == set(fresh) and shown["cpu"] == fresh["cpu"] and shown["gpu"] == fresh["gpu"]
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
    assert "8 identical experts" in page.radios["builtin:smollm2-135m-moe"].text()
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
    assert cal.result is None and "Cancelled" in cal.step.text()
    assert engine.api.load_profile() == before
