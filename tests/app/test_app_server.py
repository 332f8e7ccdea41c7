"""The app and the servers: Settings → Local API server starts and stops a real `tandem serve`; the
model page picks a remote server; a remote model's panels say "remote"."""

from __future__ import annotations

import stat

import httpx
from PySide6.QtWidgets import QLineEdit

from app.db import ChatStore
from app.main_window import MainWindow, engine_config, save_engine_settings
from app.paths import DB_NAME, REMOTE_KEY_NAME, SERVER_KEY_NAME
from app.server_control import ServerControl
from app.server_dialog import ServerDialog
from app.wizard import DONE, MODEL, SetupWizard
from app.engine_host import EngineHost
from engine.api import Engine, EngineConfig, GenerationRequest
from engine.server.launch import free_port

START_TIMEOUT_MS = 90_000


def test_settings_start_and_stop_the_local_server(qtbot, app_data):
    control = ServerControl()
    dlg = ServerDialog(control, "builtin:smollm2-135m", app_data, {}, None)
    qtbot.addWidget(dlg)
    key_file = app_data / SERVER_KEY_NAME
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600  # generated, owner-only
    key = dlg.key.text()
    assert key == key_file.read_text() and key.startswith("tdm-") and len(key) > 30
    assert dlg.key.echoMode() == QLineEdit.EchoMode.Password
    dlg.show_key.click()
    assert dlg.key.echoMode() == QLineEdit.EchoMode.Normal
    port = free_port()
    dlg.port.setValue(port)
    dlg.toggle.click()
    assert control.state == "starting" and not dlg.port.isEnabled()
    qtbot.waitUntil(lambda: control.state in ("running", "failed"), timeout=START_TIMEOUT_MS)
    try:
        assert control.state == "running", control.error
        assert dlg.address.text() == f"http://127.0.0.1:{port}/v1" == control.url
        assert "running" in dlg.status.text() and dlg.toggle.text() == "Stop the server"
        assert "/chat/completions" in dlg.example.text()
        r = httpx.get(control.url + "/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.json()["data"][0]["id"] == "builtin:smollm2-135m"
        assert httpx.get(control.url + "/models", headers={"Authorization": "Bearer x"}, timeout=10).status_code == 401
    finally:
        dlg.toggle.click()  # stop
    qtbot.waitUntil(lambda: control.state == "stopped", timeout=20_000)
    assert control.process is None and dlg.address.text() == "" and dlg.toggle.text() == "Start the server"
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        raise AssertionError("the server still answers after stop")
    except httpx.ConnectError:
        pass
    old = key
    dlg.renew.click()
    assert dlg.key.text() != old and key_file.read_text() == dlg.key.text()


def test_a_server_that_cannot_start_says_why(qtbot, app_data):
    control = ServerControl()
    control.start("builtin:no-such-model", free_port(), "k")
    qtbot.waitUntil(lambda: control.state == "failed", timeout=START_TIMEOUT_MS)
    assert "no-such-model" in control.error


def test_model_page_picks_a_remote_server(qtbot, app_data, tandem_server):
    wiz = SetupWizard({"model": "builtin:smollm2-135m-moe"}, MODEL)
    qtbot.addWidget(wiz)
    wiz.show()
    page = wiz.model_page
    qtbot.waitUntil(lambda: bool(page.radios), timeout=60_000)
    page.remote_radio.setChecked(True)
    assert not page.isComplete()  # no address yet
    page.remote_url.setText(tandem_server.url)
    page.remote_key.setText(tandem_server.api_key)
    assert page.isComplete()
    values = wiz.values()
    assert values["backend"] == "remote" and values["model"] == "auto" and values["remote_url"] == tandem_server.url
    wiz.next()
    assert wiz.currentId() == DONE and tandem_server.api_key not in wiz.page(DONE).summary.text()
    store = ChatStore(app_data / DB_NAME)
    try:
        save_engine_settings(store, values)
        assert tandem_server.api_key not in str(store.setting("engine"))  # the key is not in the database…
        assert stat.S_IMODE((app_data / REMOTE_KEY_NAME).stat().st_mode) == 0o600  # …but in an owner-only file
        cfg = engine_config(store)
        assert cfg["remote_api_key"] == tandem_server.api_key and cfg["backend"] == "remote"
        engine = Engine(EngineConfig(**cfg))  # what the app's worker loads from these settings
        assert engine.info()["model"] == "builtin:smollm2-135m"
        engine.close()
    finally:
        store.close()


def test_remote_model_panels_say_remote(qtbot, app_data, tandem_server):
    engine = Engine(EngineConfig(backend="remote", remote_url=tandem_server.url, remote_api_key=tandem_server.api_key))
    engine.generate(GenerationRequest(prompt="Hi", max_new_tokens=4, greedy=True))
    store = ChatStore(app_data / DB_NAME)
    host = EngineHost(engine)
    w = MainWindow(store, host)
    qtbot.addWidget(w)
    try:
        qtbot.waitUntil(lambda: host.state == "ready", timeout=30_000)
        assert "remote" in w.model_label.text() and tandem_server.url in w.model_label.text()
        panels = w.dock.panels
        qtbot.waitUntil(lambda: panels.last is not None, timeout=10_000)
        assert all(p.title().endswith("— remote") for p in panels.titles)
        assert "remote" in panels.speed_text.text() and "measured here" in panels.speed_text.text()
        assert "TTFT n/a" not in panels.speed_text.text()  # the client-side TTFT of the reply above
        assert "remote server" in panels.vram_text.text()
    finally:
        w.close()
        store.close()
        engine.close()
