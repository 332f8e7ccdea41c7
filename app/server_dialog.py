"""Settings → Local API server: start or stop `tandem serve`, and see its address and key.

The server loads its own copy of the model (the one the app uses, unless another is named), so
other programs on this computer can use it through any OpenAI client while the app chats.
"""

from __future__ import annotations

from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
)

from app.paths import server_key
from app.server_control import DEFAULT_PORT, ServerControl

STATES = {"stopped": "stopped", "starting": "starting (loading the model)…", "running": "running",
          "failed": "failed"}


def curl_example(url: str, key: str, model: str) -> str:
    return (f"curl {url}/chat/completions \\\n  -H 'Authorization: Bearer {key}' \\\n"
            f"  -H 'Content-Type: application/json' \\\n"
            f"  -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'")


class ServerDialog(QDialog):
    def __init__(self, control: ServerControl, model: str, folder, settings: dict, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Local API server")
        self.control, self.folder, self.settings = control, folder, dict(settings)
        self.resize(620, 380)
        form = QFormLayout()
        self.model = QLineEdit(control.model if control.state in ("starting", "running") else model)
        form.addRow("Model", self.model)
        self.port = QSpinBox()
        self.port.setRange(1024, 65535)
        self.port.setValue(int(self.settings.get("port") or DEFAULT_PORT))
        form.addRow("Port (on 127.0.0.1: this computer only)", self.port)
        self.key = QLineEdit(server_key(folder))
        self.key.setReadOnly(True)
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        key_row = QHBoxLayout()
        key_row.addWidget(self.key, 1)
        self.show_key = QPushButton("Show")
        self.show_key.setCheckable(True)
        self.show_key.toggled.connect(lambda on: self.key.setEchoMode(
            QLineEdit.EchoMode.Normal if on else QLineEdit.EchoMode.Password))
        copy = QPushButton("Copy")
        copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.key.text()))
        self.renew = QPushButton("New key")
        self.renew.clicked.connect(self.new_key)
        for b in (self.show_key, copy, self.renew):
            key_row.addWidget(b)
        form.addRow("API key", key_row)
        self.status = QLabel()
        self.status.setWordWrap(True)
        form.addRow("Status", self.status)
        self.address = QLineEdit()
        self.address.setReadOnly(True)
        form.addRow("Address", self.address)
        self.example = QLabel()
        self.example.setWordWrap(True)
        self.example.setTextInteractionFlags(self.example.textInteractionFlags().TextSelectableByMouse)
        self.toggle = QPushButton()
        self.toggle.clicked.connect(self.start_or_stop)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(self.example, 1)
        row = QHBoxLayout()
        row.addWidget(self.toggle)
        row.addStretch(1)
        row.addWidget(buttons)
        lay.addLayout(row)
        control.state_changed.connect(self._sync)
        self._sync()

    def new_key(self) -> None:
        self.key.setText(server_key(self.folder, renew=True))
        self._sync()

    def start_or_stop(self) -> None:
        if self.control.state in ("starting", "running"):
            self.control.stop()
        else:
            self.settings["port"] = self.port.value()
            self.control.start(self.model.text().strip(), self.port.value(), self.key.text())

    def _sync(self, *_):
        state = self.control.state
        busy = state in ("starting", "running")
        text = STATES[state]
        if state == "failed" and self.control.error:
            text += f": {self.control.error}"
        elif state == "running" and self.renew is not None:
            text += " — a new key applies from the next start"
        self.status.setText(text)
        self.toggle.setText("Stop the server" if busy else "Start the server")
        for w in (self.model, self.port):
            w.setEnabled(not busy)
        url = self.control.url or f"http://127.0.0.1:{self.port.value()}/v1"
        self.address.setText(self.control.url or "")
        self.example.setText("<b>Try it:</b><pre>" + curl_example(url, "$TANDEM_API_KEY", self.model.text().strip())
                             + "</pre>Any OpenAI client works: base URL = the address, API key = the key above.")
