"""The wizard's model page: a built-in model, a model already on this computer, a file or folder, or a
remote server; and how much memory and context it may use."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (QAbstractItemView, QButtonGroup, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout,
                               QHeaderView, QLabel, QLineEdit, QPushButton, QRadioButton, QSpinBox, QTreeWidget,
                               QTreeWidgetItem, QVBoxLayout, QWidget, QWizardPage)

from app.model_files import ModelInfo
from app.model_kind import describe
from app.model_scan import find_models, size_text
from app.plan_words import fit_badge, plan_for, plan_line
from app.wizard_common import Task

FOUND_COLUMNS = ("Model", "Kind", "Size", "Quantisation", "Context", "Found in", "Fit")
FOUND_MAX_HEIGHT = 150  # the list scrolls; the page still fits 1280×720


class ModelPage(QWizardPage):
    def __init__(self, current: dict, folders: list[str] | None = None, parent=None):
        super().__init__(parent)
        self.setTitle("Model and memory")
        self.setSubTitle("Which model to load, and how much memory it may use.")
        self.current = current
        self.lay = QVBoxLayout(self)
        self.group = QButtonGroup(self)
        self.builtin_box = QVBoxLayout()
        self.lay.addLayout(self.builtin_box)
        self.local_radio = QRadioButton("A model on this computer: a .gguf file or a Hugging Face folder")
        self.group.addButton(self.local_radio)
        self.lay.addWidget(self.local_radio)
        self._found_list(folders or [])
        row = QHBoxLayout()
        self.path = QLineEdit()
        self.path.setPlaceholderText("path to model.gguf or a model folder")
        self.path.textChanged.connect(self._path_changed)
        file_btn, dir_btn = QPushButton("File…"), QPushButton("Folder…")
        file_btn.clicked.connect(lambda: self._pick(QFileDialog.getOpenFileName(
            self, "GGUF model", "", "GGUF (*.gguf)")[0]))
        dir_btn.clicked.connect(lambda: self._pick(QFileDialog.getExistingDirectory(self, "Model folder")))
        row.addWidget(self.path, 1)
        row.addWidget(file_btn)
        row.addWidget(dir_btn)
        self.lay.addLayout(row)
        self._remote_fields(current)
        form = QFormLayout()
        self.vram = QDoubleSpinBox()
        self.vram.setRange(0.0, 4096.0)
        self.vram.setDecimals(1)
        self.vram.setSpecialValueText("engine decides")
        self.vram.setSuffix(" GB")
        self.vram.setValue(float(current.get("vram_budget_gb") or 0.0))
        form.addRow("GPU memory budget", self.vram)
        self.ctx = QSpinBox()
        self.ctx.setRange(0, 1 << 20)
        self.ctx.setSingleStep(1024)
        self.ctx.setSpecialValueText("the model's own")
        self.ctx.setValue(int(current.get("max_context") or 0))
        form.addRow("Context window (tokens)", self.ctx)
        self.threads = QSpinBox()
        self.threads.setRange(0, 1024)
        self.threads.setSpecialValueText("automatic")
        self.threads.setValue(int(current.get("cpu_threads") or 0))
        form.addRow("CPU threads", self.threads)
        self.lay.addLayout(form)
        self.note = QLabel()
        self.note.setWordWrap(True)
        self.lay.addWidget(self.note)
        self.plan_note = QLabel()  # the engine's placement plan for the choice on this page
        self.plan_note.setObjectName("planNote")
        self.plan_note.setWordWrap(True)
        self.lay.addWidget(self.plan_note)
        self.lay.addStretch(1)
        self.radios: dict[str, QRadioButton] = {}
        self.descriptions: dict[str, QLabel] = {}
        self.group.buttonToggled.connect(lambda *_: self.completeChanged.emit())
        self.plan_task = None
        self.plan_timer = QTimer(self)  # re-plan once the user stops changing the choice
        self.plan_timer.setSingleShot(True)
        self.plan_timer.setInterval(300)
        self.plan_timer.timeout.connect(self.replan)
        self.completeChanged.connect(self.plan_timer.start)
        for spin in (self.vram, self.ctx):
            spin.valueChanged.connect(lambda _v: self.plan_timer.start())

    def _found_list(self, folders: list[str]) -> None:
        """GGUF files and Hugging Face folders already on disk, newest first; a click picks one."""
        self.folders = list(folders)
        self.found = QTreeWidget()
        self.found.setObjectName("foundModels")
        self.found.setHeaderLabels(list(FOUND_COLUMNS))
        self.found.setRootIsDecorated(False)
        self.found.setUniformRowHeights(True)
        self.found.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.found.setMaximumHeight(FOUND_MAX_HEIGHT)
        self.found.header().setStretchLastSection(False)
        self.found.header().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for col in range(1, len(FOUND_COLUMNS)):
            self.found.header().setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        self.found.setColumnHidden(FOUND_COLUMNS.index("Fit"), True)
        self.found.itemClicked.connect(self._found_clicked)
        self.lay.addWidget(self.found)
        row = QHBoxLayout()
        self.found_note = QLabel("Looking for models on this computer…")
        self.found_note.setObjectName("panelNote")
        self.found_note.setWordWrap(True)
        row.addWidget(self.found_note, 1)
        add = QPushButton("Add a folder…")
        add.setToolTip("Also look in a folder of your own (kept for next time)")
        add.clicked.connect(lambda: self.add_folder(QFileDialog.getExistingDirectory(self, "A folder with models")))
        row.addWidget(add)
        self.lay.addLayout(row)
        self.models: list[ModelInfo] = []
        self.unusable: list = []
        self.scan_task = None

    def scan(self) -> None:
        """Look for models on a background thread (reading many headers takes a moment), each with
        the engine's plan for it under this page's budget and context (its fit badge)."""
        folders, limits = list(self.folders), self.limits()

        def find(_progress):
            models, unusable = find_models(folders)
            return models, unusable, [plan_for({"model": str(m.path), **limits}) for m in models]

        self.scan_task = Task(find, self)
        self.scan_task.done.connect(self.show_found)
        self.scan_task.start()

    def add_folder(self, folder: str) -> None:
        if folder and folder not in self.folders:
            self.folders.append(folder)
            self.scan()

    def show_found(self, result) -> None:
        self.models, self.unusable, plans = result
        self.found.clear()
        badges = False
        for m, plan in zip(self.models, plans):
            badge = fit_badge(plan)
            badges = badges or bool(badge)
            item = QTreeWidgetItem([m.name, describe(m), size_text(m.size_bytes), m.quant or "?",
                                    f"{m.context_length:,}" if m.context_length else "?", m.source, badge])
            item.setData(0, Qt.ItemDataRole.UserRole, str(m.path))
            item.setToolTip(0, f"{m.path}\n{m.architecture or 'unknown architecture'}")
            self.found.addTopLevelItem(item)
            if str(m.path) == self.path.text():
                self.found.setCurrentItem(item)
        self.found.setColumnHidden(FOUND_COLUMNS.index("Fit"), not badges)
        where = sorted({m.source for m in self.models})
        note = (f"{len(self.models)} found ({', '.join(where)}); nothing is downloaded." if self.models else
                "None found in the Hugging Face cache, LM Studio's or llama.cpp's folders. Add a folder, or pick "
                "a file below.")
        if self.unusable:
            note += f" {len(self.unusable)} could not be read (hover for why)."
            self.found_note.setToolTip("\n".join(f"{u.path}: {u.what}" for u in self.unusable))
        self.found_note.setText(note)

    def _found_clicked(self, item: QTreeWidgetItem) -> None:
        self.path.setText(item.data(0, Qt.ItemDataRole.UserRole))

    def _remote_fields(self, current: dict) -> None:
        """A model on another machine: any OpenAI-compatible server (another Tandem, llama.cpp, vLLM…)."""
        self.remote_radio = QRadioButton("A remote server (OpenAI-compatible: another Tandem, llama.cpp, vLLM, …)")
        self.group.addButton(self.remote_radio)
        self.lay.addWidget(self.remote_radio)
        remote = QFormLayout()
        self.remote_url = QLineEdit(current.get("remote_url") or "")
        self.remote_url.setPlaceholderText("http://192.168.1.20:8000/v1")
        self.remote_key = QLineEdit(current.get("remote_api_key") or "")
        self.remote_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.remote_key.setPlaceholderText("its API key (kept in a file only you can read)")
        self.remote_model = QLineEdit(current.get("model") if current.get("backend") == "remote" else "")
        self.remote_model.setPlaceholderText("model id (empty: the server's first model)")
        remote.addRow("Address", self.remote_url)
        remote.addRow("API key", self.remote_key)
        remote.addRow("Model", self.remote_model)
        self.remote_box = QWidget()  # shown only when a remote server is the choice: the page stays short
        self.remote_box.setLayout(remote)
        remote.setContentsMargins(24, 0, 0, 0)
        self.remote_box.setVisible(current.get("backend") == "remote")
        self.remote_radio.toggled.connect(self.remote_box.setVisible)
        self.lay.addWidget(self.remote_box)
        for w in (self.remote_url, self.remote_key, self.remote_model):
            w.textEdited.connect(lambda _t: (self.remote_radio.setChecked(True), self.completeChanged.emit()))

    def remote(self) -> bool:
        return self.remote_radio.isChecked()

    def _path_changed(self, text: str) -> None:
        if text:
            self.local_radio.setChecked(True)
        self.completeChanged.emit()

    def initializePage(self) -> None:
        facts = self.wizard().facts or {}
        if self.scan_task is None:
            self.scan()
        if not self.radios:
            for m in facts.get("models", []):
                rb = QRadioButton(f"{m['name']}{'  (default)' if m['default'] else ''}")
                rb.setToolTip(m["description"])
                about = QLabel(m["description"])  # a label wraps; a long radio text would widen the page
                about.setObjectName("panelNote")
                about.setWordWrap(True)
                about.setContentsMargins(24, 0, 0, 0)
                self.group.addButton(rb)
                self.builtin_box.addWidget(rb)
                self.builtin_box.addWidget(about)
                self.radios[m["name"]] = rb
                self.descriptions[m["name"]] = about
        model = self.current.get("model")
        if self.current.get("backend") == "remote":
            self.remote_radio.setChecked(True)
        elif model in self.radios:
            self.radios[model].setChecked(True)
        elif model:
            self.path.setText(model)
        elif self.radios:
            next(iter(self.radios.values())).setChecked(True)
        gpu = (facts.get("probe") or {}).get("gpu") if facts.get("has_probe") else None
        self.vram.setEnabled(gpu is not None or not facts.get("has_probe"))
        self.note.setText("" if gpu is not None or not facts.get("has_probe") else
                          "No GPU was found: the model runs on the CPU and the GPU budget does not apply.")

    def _pick(self, path: str) -> None:
        if path:
            self.path.setText(path)

    def model(self) -> str:
        if self.remote():
            return self.remote_model.text().strip() or "auto"
        for name, rb in self.radios.items():
            if rb.isChecked():
                return name
        return self.path.text().strip()

    def isComplete(self) -> bool:
        if self.remote():
            return self.remote_url.text().strip().startswith(("http://", "https://"))
        return bool(self.model())

    def limits(self) -> dict:
        """The memory and context the user allows, as EngineConfig fields."""
        return {"vram_budget_gb": self.vram.value() or None, "max_context": self.ctx.value() or None}

    def replan(self) -> None:
        """The plan of the current choice, computed off the GUI thread; the newest choice wins."""
        if self.remote() or not self.model():
            self.plan_note.setText("")
            return
        config = {"model": self.model(), **self.limits(),
                  **{k: self.current[k] for k in ("simulate_hybrid", "max_batch") if self.current.get(k)}}
        task = self.plan_task = Task(lambda _progress: plan_for(config), self)
        task.done.connect(lambda plan: self.plan_task is task and self.plan_note.setText(plan_line(plan)))
        task.start()

    def values(self) -> dict:
        v = {"model": self.model(), **self.limits(), "cpu_threads": self.threads.value() or None}
        if self.remote():  # the key goes to an owner-only file, not the settings database (main_window)
            v.update(backend="remote", remote_url=self.remote_url.text().strip(),
                     remote_api_key=self.remote_key.text().strip())
        return v


