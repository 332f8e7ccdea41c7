"""First-run wizard (and Settings → re-run): this computer, calibration, model and memory, done.

The pages live in app/wizard_machine.py (hardware, calibration) and app/wizard_model.py (model);
what they share in app/wizard_common.py. Every page fits a 1280×720 screen with its buttons visible:
long records sit behind Details boxes that scroll inside themselves.
"""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QVBoxLayout, QWizard, QWizardPage

from app.wizard_common import gather_facts
from app.wizard_machine import CalibrationPage, HardwarePage
from app.wizard_model import ModelPage

HARDWARE, CALIBRATION, MODEL, DONE = range(4)
WIZARD_SIZE = (860, 600)  # fits 1280×720 with the window frame and a panel or dock around it


def summary_rows(values: dict) -> list[tuple[str, str]]:
    """The wizard's choices in words (never the remote server's key)."""
    budget = values.get("vram_budget_gb")
    rows = [("Model", values.get("model") or "?")]
    if values.get("backend") == "remote":
        rows.append(("Server", values.get("remote_url") or "?"))
    else:
        rows += [("GPU memory budget", f"{budget:g} GB" if budget else "the engine decides"),
                 ("Context window", f"{values['max_context']:,} tokens" if values.get("max_context")
                  else "the model's own"),
                 ("CPU threads", str(values["cpu_threads"]) if values.get("cpu_threads") else "automatic")]
    return rows


class DonePage(QWizardPage):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setTitle("Ready")
        lay = QVBoxLayout(self)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)
        lay.addStretch(1)

    def initializePage(self) -> None:
        rows = "".join(f"<tr><td><b>{k}</b></td><td>{v}</td></tr>" for k, v in summary_rows(self.wizard().values()))
        self.summary.setText("Tandem loads this model and opens a chat:<table cellspacing=6>" + rows +
                             "</table>Everything here can be changed later under Settings.")


class SetupWizard(QWizard):
    def __init__(self, current: dict | None = None, start: int = HARDWARE, parent=None,
                 model_folders: list[str] | None = None):
        super().__init__(parent)
        self.setWindowTitle("Tandem setup")
        self.setWizardStyle(QWizard.WizardStyle.ModernStyle)
        self.facts: dict | None = None
        self.setPage(HARDWARE, HardwarePage())
        self.calibration = CalibrationPage()
        self.setPage(CALIBRATION, self.calibration)
        self.model_page = ModelPage(current or {}, model_folders)
        self.setPage(MODEL, self.model_page)
        self.setPage(DONE, DonePage())
        self.setStartId(start)
        if start != HARDWARE:  # pages after the first still need the engine's facts
            self.facts = gather_facts(None)
        self.setButtonText(QWizard.WizardButton.FinishButton, "Start chatting")
        self.resize(*WIZARD_SIZE)

    def values(self) -> dict:
        return self.model_page.values()

    def model_folders(self) -> list[str]:
        """The folders the user added to the model list (saved as the setting "model_folders")."""
        return list(self.model_page.folders)

    def reject(self) -> None:
        if self.calibration.busy():
            self.calibration.cancel()
            self.calibration.task.wait()
        self.finish_tasks()
        super().reject()

    def finish_tasks(self) -> None:
        """A model scan still reading headers ends before the wizard goes (it only reads, so it is quick)."""
        task = self.model_page.scan_task
        if task is not None:
            task.wait()

    def done(self, result: int) -> None:
        self.finish_tasks()
        super().done(result)
