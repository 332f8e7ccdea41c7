"""The placement plan in the app: the model page says where the chosen model would live and how fast
it would run, found models carry a fit badge, and a model whose experts exceed the GPU budget loads
with the default settings, answers, and shows its plan in the memory panel."""

import shutil

from gui_helpers import send_and_wait, set_chat

from app.db import ChatStore
from app.main_window import MainWindow
from app.paths import DB_NAME
from app.plan_words import fit_badge, plan_line
from app.wizard import MODEL, SetupWizard
from app.wizard_model import FOUND_COLUMNS
from app.engine_host import EngineHost
from engine.models import builtin

LOAD_TIMEOUT_MS = 120_000


def test_the_model_page_shows_the_plan_and_found_models_carry_a_fit_badge(qtbot, tmp_path, monkeypatch):
    home = tmp_path / "home"  # no real model folders of this machine in the list
    for var in ("HF_HUB_CACHE", "HF_HOME", "LLAMA_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    mine = tmp_path / "my-models"
    mine.mkdir()
    shutil.copy(builtin.smollm2_gguf(), mine / "SmolLM2-135M-Instruct-Q4_1.gguf")  # a real model file
    wiz = SetupWizard({"model": "builtin:smollm2-135m-moe"}, MODEL, model_folders=[str(mine)])
    qtbot.addWidget(wiz)
    wiz.show()
    page = wiz.model_page
    qtbot.waitUntil(lambda: page.found.topLevelItemCount() == 1, timeout=LOAD_TIMEOUT_MS)
    fit = FOUND_COLUMNS.index("Fit")
    assert not page.found.isColumnHidden(fit)
    assert page.found.topLevelItem(0).text(FOUND_COLUMNS.index("Kind")).startswith("Llama · 1")  # 135M parameters
    badge = page.found.topLevelItem(0).text(fit)
    assert badge == "fits on the GPU" or (badge.startswith("runs on the CPU, about ") and badge.endswith(" tok/s"))
    qtbot.waitUntil(lambda: page.plan_note.text() != "", timeout=LOAD_TIMEOUT_MS)
    assert page.plan_note.text().startswith(("Runs on the CPU", "Fits"))


def test_badges_and_lines_follow_the_plan():
    base = {"fits": True, "device": "gpu", "kv_policy": "resident", "expert_policy": "adaptive",
            "decode_tok_s": 61.4, "summary": "fits: experts cached 30% on the GPU, the rest in RAM, about 61 tok/s"}
    assert fit_badge(base) == "experts in RAM, about 61 tok/s"
    assert fit_badge({**base, "expert_policy": "resident"}) == "fits on the GPU"
    assert fit_badge({**base, "expert_policy": "resident", "kv_policy": "writescope"}).startswith("KV spills")
    assert fit_badge({**base, "device": "cpu"}) == "runs on the CPU, about 61 tok/s"
    assert fit_badge({**base, "fits": False}) == "too large for this machine"
    assert fit_badge(None) == ""
    assert plan_line(base) == "Fits: experts cached 30% on the GPU, the rest in RAM, about 61 tok/s."
    refused = {**base, "fits": False, "problem": "it needs 71.9 GiB", "remedy": "try a smaller file"}
    assert plan_line(refused) == "Does not fit: it needs 71.9 GiB. To run it, try a smaller file."


def test_experts_beyond_the_budget_run_from_the_app_and_the_plan_is_on_screen(qtbot, tmp_path, monkeypatch):
    """The simulated hybrid (a saved test setting) stands in for a 0.5 GiB GPU: the 2.4 GiB of experts
    do not fit it, and no policy is set anywhere: the plan offloads them."""
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    store = ChatStore(tmp_path / DB_NAME)
    store.set_setting("engine", {"model": "builtin:smollm2-135m-moe", "simulate_hybrid": True,
                                 "vram_budget_gb": 0.5, "max_context": 512, "max_batch": 1})
    w = MainWindow(store, EngineHost())
    qtbot.addWidget(w)
    w.show()
    w.load_model()
    qtbot.waitUntil(lambda: w.host.state == "ready", timeout=LOAD_TIMEOUT_MS)
    set_chat(w, greedy=True, max_new_tokens=10)
    result = send_and_wait(qtbot, w, "What is the capital of France?")
    assert "Paris" in result["text"]
    host_text = w.dock.panels.host_text
    qtbot.waitUntil(lambda: "Plan: Fits: experts cached" in host_text.text(), timeout=30_000)
    assert "the rest in RAM" in host_text.text()
    w.close()
    store.close()
