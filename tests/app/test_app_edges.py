"""Safe switches and clean edges: a failed model switch keeps the working model, an empty chat counts
0 tokens, New chat twice is one chat, `tandem --data-dir X` opens the app, Qt's missing libraries
are named before Qt starts, the message box's hint is not cut off."""

import os

from gui_helpers import send_and_wait, set_chat
from model_files_fixtures import truncate, write_gguf

from app.composer import PLACEHOLDER
from app.context import plan_context
from app.db import ChatStore
from app.main_window import MainWindow, engine_config
from app.paths import DB_NAME, InstanceLock
from app.qt_check import debian_package, describe_missing, missing_from_ldd, uses_xcb
from app.engine_host import EngineHost
from engine.cli import main as cli_main

MOE = "builtin:smollm2-135m-moe"


def test_a_damaged_model_file_keeps_the_working_model(qtbot, open_window, tmp_path):
    w = open_window()
    damaged = truncate(write_gguf(tmp_path / "Broken-Q4_K_M.gguf"))
    w.apply_setup({"model": str(damaged)})
    qtbot.waitUntil(lambda: w.banner.isVisibleTo(w) and w.host.state == "ready", timeout=30_000)
    text = w.banner_text.text()
    assert "could not be loaded" in text and "truncated" in text and f"Still using <b>{MOE}</b>" in text
    assert not w.retry_btn.isVisibleTo(w) and w.choose_btn.isVisibleTo(w)
    assert w.host.info["model"] == MOE and "No model loaded" not in w.model_label.text()
    assert engine_config(w.store)["model"] == MOE  # the next start loads what works
    set_chat(w, greedy=True, max_new_tokens=4)
    assert send_and_wait(qtbot, w, "Hello")["completion_tokens"] > 0  # still chatting on the old model


def test_a_load_that_fails_after_the_header_puts_the_previous_model_back(qtbot, app_data, tmp_path):
    store = ChatStore(app_data / DB_NAME)
    host = EngineHost()  # owns its engine: the switch closes it, so the failure must load it again
    w = MainWindow(store, host, {"model": "builtin:smollm2-135m", "device": "cpu"})
    qtbot.addWidget(w)
    w.load_model()
    qtbot.waitUntil(lambda: host.state == "ready", timeout=120_000)
    first = host.worker.engine
    valid_but_unloadable = write_gguf(tmp_path / "tiny.gguf")  # a sound header, but no model in it
    w.overrides["model"] = str(valid_but_unloadable)
    w.load_model()
    qtbot.waitUntil(lambda: w.banner.isVisibleTo(w) and host.state == "ready", timeout=120_000)
    assert host.worker.engine is not first and host.info["model"] == "builtin:smollm2-135m"
    assert "Still using <b>builtin:smollm2-135m</b>" in w.banner_text.text()
    w.close()
    store.close()


def test_an_empty_chat_counts_zero_tokens(qtbot, open_window, moe_engine, capfd):
    w = open_window()
    qtbot.waitUntil(lambda: w.composer.plan is not None, timeout=10_000)
    assert w.composer.plan.tokens == 0 and w.composer.gauge.text().startswith("context: 0 / ")
    plan = plan_context(moe_engine.render, "", [], None, moe_engine.max_context, 512, "drop_oldest")
    assert plan.tokens == 0 and plan.action == "ok"
    assert "ValueError" not in capfd.readouterr().err


def test_new_chat_twice_is_one_chat(qtbot, open_window):
    w = open_window()
    before = len(w.store.chats())
    first = w.chat_list.new_chat()
    assert w.chat_list.new_chat() == first and w.conv.chat_id == first
    assert len(w.store.chats()) == before
    w.chat_list.rename(first, "Kept")  # a named chat is not "untouched": the next New chat is another
    assert w.chat_list.new_chat() != first


def test_tandem_without_the_word_gui_opens_the_app(app_data, capsys):
    held = InstanceLock(app_data)
    assert held.acquire() is None
    assert cli_main(["--data-dir", str(app_data)]) == 3  # reached the app: it found the folder in use
    assert "already running" in capsys.readouterr().err
    held.release()


LDD = """\tlinux-vdso.so.1 (0x00007ffd)
\tlibQt6XcbQpa.so.6 => /site-packages/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f)
\tlibxcb-cursor.so.0 => not found
\tlibxcb-icccm.so.4 => not found
\tlibxkbcommon-x11.so.0 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-icccm.so.4 => not found
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)
"""


def test_missing_qt_libraries_are_named_as_packages():
    missing = missing_from_ldd(LDD)
    assert missing == ["libxcb-cursor.so.0", "libxcb-icccm.so.4", "libxkbcommon-x11.so.0", "libxcb-keysyms.so.1"]
    what, remedy = describe_missing(missing)
    assert "libxcb-cursor.so.0" in what
    assert remedy.startswith("install the system packages (Debian/Ubuntu): sudo apt-get install libxcb-cursor0 "
                             "libxcb-icccm4 libxkbcommon-x11-0 libxcb-keysyms1")
    assert debian_package("libxcb-util.so.1") == "libxcb-util1" and debian_package("libfoo2.so.0") == "libfoo2-0"
    assert uses_xcb({"DISPLAY": ":0"}, "linux") and not uses_xcb({"WAYLAND_DISPLAY": "wayland-0"}, "linux")
    assert not uses_xcb({"QT_QPA_PLATFORM": "offscreen"}, "linux") and uses_xcb({"QT_QPA_PLATFORM": "xcb"}, "linux")
    assert not uses_xcb({}, "darwin")


def test_the_message_box_hint_fits(qtbot, open_window):
    w = open_window()
    w.resize(1280, 720)
    qtbot.wait(100)
    edit = w.composer.edit
    assert edit.placeholderText() == PLACEHOLDER
    assert edit.fontMetrics().horizontalAdvance(PLACEHOLDER) < edit.viewport().width()
    assert edit.viewport().height() >= 2 * edit.fontMetrics().lineSpacing()
    assert os.environ["QT_QPA_PLATFORM"] == "offscreen"
