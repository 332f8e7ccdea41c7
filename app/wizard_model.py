"""The wizard's model page: a built-in model, a model already on this computer, a file or folder, or a
remote server; and how much memory and context it may use."""

from __future__ import annotations

from PySide6.QtWidgets import (QButtonGroup, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel,
                               QLineEdit, QPushButton, QRadioButton, QSpinBox, QVBoxLayout, QWizardPage)


class ModelPage(QWizardPage):
    def __init__(self, current: dict, parent=None):
        super().__init__(parent)
        self.setTitle("Model and memory")
        self.setSubTitle("Which model to load, and how much memory it may use.")
        self.current = current
        self.lay = QVBoxLayout(self)
        self.group = QButtonGroup(self)
        self.builtin_box = QVBoxLayout()
        self.lay.addLayout(self.builtin_box)
        self.local_radio = QRadioButton("A local model: a .gguf file or a Hugging Face folder (config.json + "
                                        "*.safetensors)")
        self.group.addButton(self.local_radio)
        self.lay.addWidget(self.local_radio)
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
        self.lay.addStretch(1)
        self.radios: dict[str, QRadioButton] = {}
        self.group.buttonToggled.connect(lambda *_: self.completeChanged.emit())

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
        self.lay.addLayout(remote)
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
        if not self.radios:
            for m in facts.get("models", []):
                rb = QRadioButton(f"{m['name']}{'  (default)' if m['default'] else ''}\n{m['description']}")
                self.group.addButton(rb)
                self.builtin_box.addWidget(rb)
                self.radios[m["name"]] = rb
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

    def values(self) -> dict:
        v = {"model": self.model(), "vram_budget_gb": self.vram.value() or None,
             "max_context": self.ctx.value() or None, "cpu_threads": self.threads.value() or None}
        if self.remote():  # the key goes to an owner-only file, not the settings database (main_window)
            v.update(backend="remote", remote_url=self.remote_url.text().strip(),
                     remote_api_key=self.remote_key.text().strip())
        return v


