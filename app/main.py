"""`tandem` / `tandem gui`: open the desktop app (first launch: the setup wizard, then the chat window)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandem gui", description="Open the Tandem desktop app.")
    p.add_argument("--model", default=None, help="model to load this time (builtin:…, a .gguf file or a folder)")
    p.add_argument("--device", default=None, help="auto | cuda | cpu")
    p.add_argument("--max-context", type=int, default=None, help="context window in tokens")
    p.add_argument("--vram-budget-gb", type=float, default=None)
    p.add_argument("--data-dir", default=None, help="where chats and settings live (default: $TANDEM_DATA_DIR "
                                                   "or the user data folder)")
    p.add_argument("--skip-wizard", action="store_true", help="do not open the setup wizard on first launch")
    return p.parse_args(argv)


def make_application(argv: list[str]):
    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication(["tandem", *argv])
    app.setApplicationName("Tandem")
    app.setOrganizationName("Tandem")
    app.setDesktopFileName("tandem")  # Wayland's app id: docks match the window to tandem.desktop and its icon
    icon = ASSETS / "tandem.svg"
    if icon.is_file():
        app.setWindowIcon(QIcon(str(icon)))
    style = ASSETS / "style.qss"
    if style.is_file():
        from app.theme import style_sheet

        app.setStyleSheet(style_sheet(style))  # light or dark, as the system's palette is
    return app


def refuse_start(title: str, what: str, remedy: str) -> int:
    """A start that cannot go on: the cause and the remedy on stderr and in a dialog, exit status 4."""
    print(f"error: {what}\nwhat to do: {remedy}", file=sys.stderr)
    if os.environ.get("QT_QPA_PLATFORM") != "offscreen":
        from PySide6.QtWidgets import QMessageBox

        QMessageBox.critical(None, title, f"{what}\n\nWhat to do: {remedy}")
    return 4


def install_error_hook(window) -> None:
    """A save that fails inside a Qt slot (disk full, read-only) is told in the status bar, one line on
    stderr, no traceback; the app goes on. Every other exception keeps Python's report."""
    from app.db import StoreError

    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, StoreError):
            print(f"error: {value.what} — {value.remedy}", file=sys.stderr)
            window.statusBar().showMessage(f"{value.what}. {value.remedy}", 15000)
            return
        previous(kind, value, tb)

    sys.excepthook = hook


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(argv if argv is not None else sys.argv[1:]))
    from app.qt_check import check_qt_platform

    problem = check_qt_platform()  # before QApplication: without its libraries Qt aborts the process
    if problem is not None:
        print(f"error: {problem[0]}\nwhat to do: {problem[1]}", file=sys.stderr)
        return 4
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QDialog, QMessageBox

    from app.db import ChatStore, StoreError
    from app.main_window import MainWindow, engine_config, save_engine_settings
    from app.paths import DB_NAME, DataDirError, InstanceLock, check_writable, data_dir
    from app.wizard import SetupWizard
    from app.engine_host import EngineHost

    app = make_application([])
    try:
        folder = data_dir(args.data_dir)
        check_writable(folder)
    except DataDirError as e:
        return refuse_start("Tandem cannot use its data folder", e.what, e.remedy)
    lock = InstanceLock(folder)
    holder = lock.acquire()
    if holder is not None:
        text = (f"Tandem is already running with the data folder {folder} ({holder.describe()}).\n\n"
                "Switch to that window, or close it first. To run a second, separate copy, give it its own "
                "folder with --data-dir or TANDEM_DATA_DIR.")
        print("error: " + text.replace("\n\n", " "), file=sys.stderr)
        if os.environ.get("QT_QPA_PLATFORM") != "offscreen":
            QMessageBox.critical(None, "Tandem is already running", text)
        return 3
    try:
        store = ChatStore(folder / DB_NAME)
    except StoreError as e:
        lock.release()
        return refuse_start("Tandem cannot open its chats", e.what, e.remedy)
    overrides = {"model": args.model, "device": args.device, "max_context": args.max_context,
                 "vram_budget_gb": args.vram_budget_gb}
    previous_hook = sys.excepthook
    try:
        if not store.setting("wizard_done") and not args.skip_wizard:
            wiz = SetupWizard(engine_config(store, overrides), model_folders=store.setting("model_folders", []))
            if wiz.exec() == QDialog.DialogCode.Accepted:
                save_engine_settings(store, wiz.values())
                store.set_setting("model_folders", wiz.model_folders())
                store.set_setting("wizard_done", True)
                overrides["model"] = None  # the wizard's choice wins over --model from here on
        host = EngineHost()
        window = MainWindow(store, host, overrides)
        install_error_hook(window)
        window.show()
        window.load_model()
        # Ctrl+C in the terminal closes the window as the Quit menu does (stop, join, free the engine).
        # Python only runs signal handlers between bytecodes, so a timer wakes it a few times a second.
        signal.signal(signal.SIGINT, lambda *_: window.close())
        wake = QTimer()
        wake.timeout.connect(lambda: None)
        wake.start(250)
        rc = app.exec()
        host.shutdown()  # no-op when the window's close already did it
        return rc
    finally:
        sys.excepthook = previous_hook
        store.close()
        lock.release()
