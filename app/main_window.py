"""The main window: chat list | chat (header, messages, composer) | live panels dock; menus; exports."""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import QCoreApplication, Qt
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QDialog, QFileDialog, QHBoxLayout, QLabel, QMainWindow, QMessageBox, QProgressBar,
                               QPushButton, QSplitter, QVBoxLayout, QWidget)

from app import export
from app.chat_list import ChatList
from app.chat_settings import ChatSettingsDialog
from app.chat_view import ChatView
from app.composer import Composer
from app.conversation import Conversation
from app.db import ChatStore
from app.panels import PanelsDock
from app.paths import REMOTE_KEY_NAME, read_secret, write_secret
from app.server_control import ServerControl
from app.server_dialog import ServerDialog
from app.wizard import CALIBRATION, HARDWARE, MODEL, SetupWizard

DEFAULT_MODEL = "builtin:smollm2-135m-moe"
# simulate_hybrid and max_batch are not on any page: a saved setting (tests run the hybrid path with it)
CONFIG_KEYS = ("model", "vram_budget_gb", "max_context", "cpu_threads", "simulate_hybrid", "max_batch")
REMOTE_CONFIG_KEYS = ("backend", "remote_url")  # a remote server picked in the model page (its key: a secret file)


def engine_config(store: ChatStore, overrides: dict | None = None) -> dict:
    """EngineConfig fields from the saved settings, with command-line overrides on top."""
    saved = store.setting("engine", {}) or {}
    cfg = {k: saved.get(k) for k in CONFIG_KEYS + REMOTE_CONFIG_KEYS if saved.get(k) is not None}
    cfg.update({k: v for k, v in (overrides or {}).items() if v is not None})
    cfg.setdefault("model", DEFAULT_MODEL)
    if cfg.get("backend") == "remote":
        cfg["remote_api_key"] = read_secret(store.path.parent, REMOTE_KEY_NAME)
    return cfg


def save_engine_settings(store: ChatStore, values: dict) -> None:
    """The model page's choice: settings in the database, a remote server's key in an owner-only file."""
    if values.get("remote_api_key") is not None:
        write_secret(store.path.parent, REMOTE_KEY_NAME, values["remote_api_key"])
    store.set_setting("engine", {k: values.get(k) for k in CONFIG_KEYS + REMOTE_CONFIG_KEYS})


class MainWindow(QMainWindow):
    def __init__(self, store: ChatStore, host, overrides: dict | None = None, parent=None):
        super().__init__(parent)
        self.store, self.host = store, host
        self.overrides = dict(overrides or {})
        self.working_settings = None  # the saved engine settings of the model that loaded last
        self.loaded_model: str | None = None
        self.timeline = export.StatsTimeline()
        self.setWindowTitle("Tandem")
        self.resize(1280, 820)

        self.chat_list = ChatList(store)
        center = QWidget()
        cl = QVBoxLayout(center)
        cl.setContentsMargins(6, 6, 6, 6)
        head = QHBoxLayout()
        self.title_label = QLabel()
        self.title_label.setObjectName("chatTitle")
        head.addWidget(self.title_label, 1)
        self.settings_btn = QPushButton("⚙ Chat settings")
        self.settings_btn.clicked.connect(self.edit_chat_settings)
        head.addWidget(self.settings_btn)
        cl.addLayout(head)
        self.model_label = QLabel()
        self.model_label.setObjectName("modelLabel")
        self.model_label.setWordWrap(True)
        cl.addWidget(self.model_label)
        self.banner = QWidget()
        self.banner.setObjectName("loadBanner")
        bl = QHBoxLayout(self.banner)
        self.banner_text = QLabel()
        self.banner_text.setWordWrap(True)
        bl.addWidget(self.banner_text, 1)
        self.retry_btn = QPushButton("Retry")
        self.retry_btn.clicked.connect(self.load_model)
        self.choose_btn = QPushButton("Choose another model…")
        self.choose_btn.clicked.connect(lambda: self.open_wizard(MODEL))
        bl.addWidget(self.retry_btn)
        bl.addWidget(self.choose_btn)
        self.banner.hide()
        cl.addWidget(self.banner)
        self.view = ChatView()
        cl.addWidget(self.view, 1)
        self.composer = Composer()
        cl.addWidget(self.composer)
        split = QSplitter()
        split.addWidget(self.chat_list)
        split.addWidget(center)
        split.setStretchFactor(1, 1)
        split.setSizes([250, 730])
        self.setCentralWidget(split)
        self.dock = PanelsDock(self)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.dock)
        self.load_bar = QProgressBar()
        self.load_bar.setRange(0, 100)
        self.load_bar.setMaximumWidth(220)
        self.load_bar.hide()
        self.statusBar().addPermanentWidget(self.load_bar)

        self.server = ServerControl(self)  # the local API server (Settings → Local API server…)
        self.server_label = QLabel()
        self.statusBar().addPermanentWidget(self.server_label)
        self.server.state_changed.connect(self._server_state)

        self.conv = Conversation(store, host, self.view, self.composer, self)
        self.conv.notice.connect(lambda text: self.statusBar().showMessage(text, 10000))
        self.conv.chats_changed.connect(self._chats_changed)
        self.conv.busy_changed.connect(self._busy)
        self.chat_list.chat_selected.connect(self.show_chat)
        self.chat_list.chat_deleted.connect(self._deleted)
        self.chat_list.chat_renamed.connect(lambda _id: self._chats_changed())
        w = host.worker
        w.load_progress.connect(self._load_progress)
        w.load_failed.connect(self._load_failed)
        w.switch_failed.connect(self._switch_failed)
        w.stats.connect(self._stats)
        w.prefill_progress.connect(self._reading)  # a bound method: queued to this thread, as a lambda is not
        host.state_changed.connect(self._engine_state)
        self._menus()
        self._engine_state(host.state)
        if store.recovered:
            self.statusBar().showMessage(f"{store.recovered} reply(s) cut off when the app last closed are marked "
                                         "'interrupted'.", 15000)
        chats = store.chats()
        if chats:
            self.chat_list.select(chats[0].id)
        else:
            self.chat_list.new_chat()

    # -- menus ----------------------------------------------------------------------------------
    def _menus(self) -> None:
        def act(menu, text, slot, shortcut=None):
            a = QAction(text, self)
            a.triggered.connect(slot)
            if shortcut:
                a.setShortcut(QKeySequence(shortcut))
            menu.addAction(a)
            return a

        f = self.menuBar().addMenu("&File")
        act(f, "New chat", self.chat_list.new_chat, "Ctrl+N")
        f.addSeparator()
        act(f, "Export chat as Markdown…", lambda: self._export("chat Markdown", "Markdown (*.md)", ".md",
                                                                 self.export_chat_markdown))
        act(f, "Export chat as JSON…", lambda: self._export("chat JSON", "JSON (*.json)", ".json",
                                                             self.export_chat_json))
        act(f, "Export session stats (JSON + CSV)…", lambda: self._export(
            "session stats", "JSON (*.json)", ".json", self.export_stats))
        act(f, "Save panels as PNG…", lambda: self._export("panels", "PNG (*.png)", ".png", self.export_panels_png))
        f.addSeparator()
        act(f, "Quit", self.close, "Ctrl+Q")
        c = self.menuBar().addMenu("&Chat")
        act(c, "Chat settings…", self.edit_chat_settings, "Ctrl+,")
        act(c, "Regenerate last reply", self.conv.regenerate_last, "Ctrl+R")
        act(c, "Stop the reply", self.conv.stop, "Esc")
        s = self.menuBar().addMenu("&Settings")
        act(s, "Setup wizard…", lambda: self.open_wizard(HARDWARE))
        act(s, "Calibration…", lambda: self.open_wizard(CALIBRATION))
        act(s, "Model and memory…", lambda: self.open_wizard(MODEL))
        act(s, "Local API server…", self.open_server_dialog)
        s.addAction(self.dock.toggleViewAction())
        h = self.menuBar().addMenu("&Help")
        act(h, "About Tandem", self.about)

    # -- chats ----------------------------------------------------------------------------------
    def show_chat(self, chat_id: str) -> None:
        chat = self.store.chat(chat_id) if chat_id else None
        self.title_label.setText(f"<h3>{chat.title}</h3>" if chat else "<h3>No chat</h3>")
        self.settings_btn.setEnabled(chat is not None)
        self.conv.set_chat(chat.id if chat else "")

    def _chats_changed(self) -> None:
        self.chat_list.reload()
        chat = self.store.chat(self.conv.chat_id) if self.conv.chat_id else None
        if chat is not None:
            self.title_label.setText(f"<h3>{chat.title}</h3>")

    def _deleted(self, chat_id: str) -> None:
        if self.conv.job and self.conv.job.chat_id == chat_id:
            self.conv.stop()
        self.host.end_session(chat_id)  # free the chat's KV in the engine now, not on its LRU turn

    def edit_chat_settings(self) -> None:
        chat = self.store.chat(self.conv.chat_id) if self.conv.chat_id else None
        if chat is None:
            return
        dlg = ChatSettingsDialog(chat.settings, self)
        if dlg.exec() == QDialog.DialogCode.Accepted:
            self.apply_chat_settings(dlg.values(), dlg.as_default.isChecked())

    def apply_chat_settings(self, values: dict, as_default: bool = False) -> None:
        self.store.set_chat_settings(self.conv.chat_id, values)
        if as_default:
            self.store.set_setting("chat_defaults", values)
        self.conv.schedule_replan()

    def _busy(self, busy: bool) -> None:
        self.chat_list.delete_btn.setEnabled(not busy and self.chat_list.list.currentItem() is not None)

    # -- engine ---------------------------------------------------------------------------------
    def load_model(self) -> None:
        self.host.load(engine_config(self.store, self.overrides))

    def _engine_state(self, state: str) -> None:
        if state == "loading":
            self.banner.hide()
            self.load_bar.setValue(0)
            self.load_bar.show()
            self.model_label.setText(f"Loading {engine_config(self.store, self.overrides)['model']}…")
        elif state == "ready":
            self.load_bar.hide()
            self.working_settings = self.store.setting("engine")  # what a failed switch goes back to
            i = self.host.info
            self.loaded_model = i["model"]
            if i.get("backend") == "remote":
                self.model_label.setText(f"<b>{i['model']}</b> — <b>remote</b> server {i.get('remote_url')} · "
                                         f"{i['max_context']:,}-token context ({i.get('context_source')})")
                self.statusBar().showMessage("Connected to the remote server.", 5000)
                self.conv.schedule_replan()
                return
            desc = f" — {i['description']}" if i.get("description") else ""
            experts = f" · {i['experts']} experts, top-{i['top_k']}" if i.get("experts") else ""
            kind = i.get("kind") or i["family"]  # a file's family and size, by the names people know them
            self.model_label.setText(f"<b>{i['model']}</b>{desc}<br>{kind}, {i['layers']} layers{experts} · "
                                     f"{i['device']} · {i['dtype']} · {i['max_context']:,}-token context")
            self.statusBar().showMessage("Model loaded.", 5000)
        elif state in ("failed", "empty"):
            self.load_bar.hide()
        self.conv.schedule_replan()

    def _load_progress(self, step: str, frac: float) -> None:
        self.load_bar.setValue(int(100 * frac))
        self.load_bar.setFormat(f"{step} %p%")
        self.statusBar().showMessage(f"Loading model: {step}")

    def _load_failed(self, what: str, remedy: str) -> None:
        self.model_label.setText("No model loaded.")
        self.retry_btn.show()
        self.banner_text.setText(f"<b>The model could not be loaded:</b> {what}"
                                 + (f"<br><b>What to do:</b> {remedy}" if remedy else "")
                                 + "<br>Your chats are still here; you can read and export them.")
        self.banner.show()

    def _switch_failed(self, what: str, remedy: str) -> None:
        """Another model was chosen and could not be used: the working one stays, and so do its settings
        (the next start loads what works, not the file that failed)."""
        wanted = engine_config(self.store, self.overrides)["model"]
        self.store.set_setting("engine", self.working_settings or {})  # {}: the defaults it started with
        kept = self.loaded_model or "the previous model"
        self.banner_text.setText(f"<b>{wanted} could not be loaded:</b> {what}"
                                 + (f"<br><b>What to do:</b> {remedy}" if remedy else "")
                                 + f"<br>Still using <b>{kept}</b>; nothing was changed.")
        self.retry_btn.hide()  # retrying would load the same file again; choosing another is the way on
        self.banner.show()
        self.statusBar().showMessage(f"Kept {kept}: the new model could not be loaded.", 15000)

    def _reading(self, _job_id: str, done: int, total: int) -> None:
        self.dock.panels.set_reading(done, total)

    def _stats(self, snap: dict) -> None:
        self.timeline.add(snap)
        self.dock.panels.update_snapshot(snap)

    def open_wizard(self, start: int = HARDWARE) -> bool:
        current = engine_config(self.store, self.overrides)
        wiz = SetupWizard(current, start, self, model_folders=self.store.setting("model_folders", []))
        if wiz.exec() != QDialog.DialogCode.Accepted:
            return False
        self.store.set_setting("model_folders", wiz.model_folders())
        # A new calibration profile is read when the engine loads: reload to put it to use.
        self.apply_setup(wiz.values(), reload=wiz.calibration.result is not None)
        return True

    def apply_setup(self, values: dict, reload: bool = False) -> None:
        before = engine_config(self.store, self.overrides)
        save_engine_settings(self.store, values)
        self.store.set_setting("wizard_done", True)
        self.overrides = {k: v for k, v in self.overrides.items() if k not in CONFIG_KEYS}
        if reload or engine_config(self.store, self.overrides) != before or self.host.state != "ready":
            self.load_model()

    # -- local API server -----------------------------------------------------------------------
    def open_server_dialog(self) -> ServerDialog:
        cfg = engine_config(self.store, self.overrides)
        model = cfg["model"] if cfg.get("backend") != "remote" else DEFAULT_MODEL
        dlg = ServerDialog(self.server, model, self.store.path.parent, self.store.setting("server", {}) or {}, self)
        dlg.finished.connect(lambda *_: self.store.set_setting("server", dlg.settings))
        dlg.open()
        return dlg

    def _server_state(self, state: str) -> None:
        if state == "running":
            self.server_label.setText(f"API server: {self.server.url}")
        elif state == "failed":
            self.server_label.setText("API server: failed")
            self.statusBar().showMessage(f"The API server stopped: {self.server.error}", 15000)
        else:
            self.server_label.setText("API server: starting…" if state == "starting" else "")

    # -- exports --------------------------------------------------------------------------------
    def _export(self, what: str, filt: str, suffix: str, fn) -> None:
        chat = self.store.chat(self.conv.chat_id) if self.conv.chat_id else None
        stem = "tandem-" + (chat.title if chat and what.startswith("chat") else time.strftime("session-%Y%m%d-%H%M"))
        stem = "".join(ch if ch.isalnum() or ch in "-_ " else "_" for ch in stem).strip()
        path, _ = QFileDialog.getSaveFileName(self, f"Export {what}", stem + suffix, filt)
        if path:
            try:
                written = fn(path)
            except OSError as e:  # disk full, read-only folder: say so; nothing in the app changed
                self.statusBar().showMessage(f"Could not export to {path}: {e.strerror or e}. Free some space or "
                                             "choose another folder.", 15000)
                return
            self.statusBar().showMessage("Wrote " + ", ".join(str(p) for p in written), 10000)

    def export_chat_markdown(self, path) -> list[Path]:
        chat = self.store.chat(self.conv.chat_id)
        return [export.write_chat_markdown(path, chat, self.store.messages(chat.id))]

    def export_chat_json(self, path) -> list[Path]:
        chat = self.store.chat(self.conv.chat_id)
        model = (self.host.info or {}).get("model")
        return [export.write_chat_json(path, chat, self.store.messages(chat.id), model)]

    def export_stats(self, path) -> list[Path]:
        """The session's StatsSnapshot timeline: PATH (JSON) and the same name with .csv."""
        path = Path(path)
        return [self.timeline.write_json(path), self.timeline.write_csv(path.with_suffix(".csv"))]

    def export_panels_png(self, path) -> list[Path]:
        return [export.write_panels_png(path, self.dock.panels)]

    def about(self) -> None:
        QMessageBox.about(self, "About Tandem", (
            "<b>Tandem</b> — private, long-context chat with Mixture-of-Experts models on one GPU plus the CPU, "
            "offline.<p>The default model, <b>builtin:smollm2-135m-moe</b>, is SmolLM2-135M-Instruct "
            "sparse-upcycled at load time into 8 identical experts per layer (top-2). It answers exactly as the "
            "dense model does: it is a demonstration that makes every expert panel live, not a better model."))

    # -- quit -----------------------------------------------------------------------------------
    def closeEvent(self, event) -> None:
        self.server.stop()
        self.conv.stop()
        self.host.shutdown()
        QCoreApplication.processEvents()  # the worker's last queued reports (the stopped reply's result)
        self.conv.abandon()
        super().closeEvent(event)
