"""GUI tests run offscreen against the real engine on the built-in MoE model (shared, loaded once)."""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app.db import ChatStore  # noqa: E402
from app.main_window import MainWindow  # noqa: E402
from app.paths import DB_NAME, data_dir  # noqa: E402
from app.engine_host import EngineHost  # noqa: E402

LOAD_TIMEOUT_MS = 60_000


@pytest.fixture
def app_data(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    return data_dir()


@pytest.fixture
def open_window(qtbot, moe_engine, app_data):
    """open_window() → a MainWindow on the test's data dir, driving the shared engine (not closing it)."""
    opened = []

    def make(engine=moe_engine):
        store = ChatStore(app_data / DB_NAME)
        host = EngineHost(engine)
        w = MainWindow(store, host)
        qtbot.addWidget(w)
        w.show()
        if engine is not None:
            qtbot.waitUntil(lambda: host.state == "ready", timeout=LOAD_TIMEOUT_MS)
        opened.append(w)
        return w

    yield make
    for w in opened:
        if w.host.state != "closed":
            w.close()
        w.store.close()

