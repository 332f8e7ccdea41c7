"""The model page lists what is already on disk: a fake Hugging Face hub cache, LM Studio and llama.cpp
folders and a folder of the user's, holding real tiny GGUF files and safetensors folders."""

import os
from pathlib import Path

import pytest
from model_files_fixtures import truncate, write_gguf, write_hf_folder

from app.model_files import ModelFileError, inspect_model
from app.model_scan import find_models
from app.wizard import MODEL, SetupWizard


@pytest.fixture
def disk(tmp_path, monkeypatch):
    home = tmp_path / "home"
    for var in ("HF_HUB_CACHE", "HF_HOME", "LLAMA_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    hub = home / ".cache" / "huggingface" / "hub"
    snap = hub / "models--Qwen--Tiny-MoE" / "snapshots" / "abc123"
    write_hf_folder(snap, context=32768)
    (hub / "models--Qwen--Tiny-MoE" / "refs").mkdir(parents=True)
    (hub / "models--Qwen--Tiny-MoE" / "refs" / "main").write_text("abc123")
    gsnap = hub / "models--bartowski--Tiny-GGUF" / "snapshots" / "def456"
    write_gguf(gsnap / "Tiny-Q4_K_M.gguf", name="Tiny", context=8192, file_type=15)
    write_gguf(gsnap / "mmproj-Tiny-f16.gguf", context=0)  # a vision projector: not a model of its own
    lms = write_gguf(home / ".lmstudio" / "models" / "lmstudio-community" / "Mini" / "Mini-Q8_0.gguf",
                     context=16384, file_type=7, rows=256)
    llama = write_gguf(home / ".cache" / "llama.cpp" / "ggml-org_Small-BF16.gguf", context=4096, file_type=32)
    mine = tmp_path / "my-models"
    write_gguf(mine / "Part-00001-of-00002.gguf", context=2048)
    write_gguf(mine / "Part-00002-of-00002.gguf", context=2048)
    broken = truncate(write_gguf(mine / "Broken.gguf"))
    times = {snap / "model.safetensors": 400, gsnap / "Tiny-Q4_K_M.gguf": 500, lms: 300, llama: 200,
             mine / "Part-00001-of-00002.gguf": 100}
    for path, age in times.items():
        t = 1_800_000_000 - age
        os.utime(path, (t, t))
    return {"mine": mine, "broken": broken, "lms": lms}


def test_models_on_disk_are_found_newest_first(disk):
    found, bad = find_models([str(disk["mine"])])
    rows = [(m.name, m.source, m.quant, m.context_length) for m in found]
    assert rows == [("Part-00001-of-00002.gguf", "your folder", "F16", 2048),
                    ("ggml-org_Small-BF16.gguf", "llama.cpp", "BF16", 4096),
                    ("Mini-Q8_0.gguf", "LM Studio", "Q8_0", 16384),
                    ("Qwen/Tiny-MoE", "Hugging Face cache", "F16", 32768),
                    ("bartowski/Tiny-GGUF · Tiny-Q4_K_M.gguf", "Hugging Face cache", "Q4_K_M", 8192)]
    split = found[0]
    assert split.size_bytes == sum(p.stat().st_size for p in split.parts) and len(split.parts) == 2
    assert found[2].size_bytes == disk["lms"].stat().st_size
    assert [(u.path.name, "truncated" in u.what) for u in bad] == [("Broken.gguf", True)]
    with pytest.raises(ModelFileError, match="truncated"):
        inspect_model(disk["broken"])


def test_the_model_page_lists_them_and_a_click_picks_one(qtbot, disk):
    wiz = SetupWizard({"model": "builtin:smollm2-135m-moe"}, MODEL, model_folders=[str(disk["mine"])])
    qtbot.addWidget(wiz)
    wiz.show()
    page = wiz.model_page
    qtbot.waitUntil(lambda: page.found.topLevelItemCount() == 5, timeout=30_000)
    first = page.found.topLevelItem(0)
    assert [first.text(i) for i in range(6)] == ["Part-00001-of-00002.gguf", "Llama", first.text(2), "F16", "2,048",
                                                 "your folder"]
    assert first.text(2).endswith(("KB", "B"))
    assert page.found.topLevelItem(3).text(1) == "Qwen3-MoE · 256 parameters"  # the hub folder's one tensor
    assert page.found.isColumnHidden(6)  # no fit verdict until the placement plan provides one
    assert "1 could not be read" in page.found_note.text() and "Broken.gguf" in page.found_note.toolTip()
    hub = page.found.topLevelItem(3)
    page._found_clicked(hub)
    assert page.local_radio.isChecked() and wiz.values()["model"] == str(Path(hub.data(0, 256)))
    assert wiz.values()["model"].endswith("snapshots/abc123")
    assert wiz.model_folders() == [str(disk["mine"])]
