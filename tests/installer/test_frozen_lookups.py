"""What changes when the code runs inside the PyInstaller bundle (sys.frozen, sys._MEIPASS)."""

import sys

import pytest

from engine.errors import ModelFileError
from engine.models import builtin


def test_builtin_model_is_found_inside_the_bundle(tmp_path, monkeypatch):
    inside = tmp_path / builtin.SMOLLM2_PACKAGE / builtin.SMOLLM2_FILE
    inside.parent.mkdir()
    inside.write_bytes(b"GGUF")  # only the lookup is under test here; the bundle test loads the real file
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
    assert builtin.smollm2_gguf() == inside
    path, recipe = builtin.resolve("builtin:smollm2-135m-moe")
    assert path == inside and recipe.n_experts == 8


def test_a_bundle_without_the_model_says_to_reinstall(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
    with pytest.raises(ModelFileError) as e:
        builtin.smollm2_gguf()
    assert "missing from this bundle" in e.value.what and "reinstall" in e.value.remedy


def test_the_app_starts_its_server_through_the_bundled_executable(monkeypatch):
    pytest.importorskip("PySide6")
    from app.server_control import ServerControl

    args = ["--model", "builtin:smollm2-135m", "--host", "127.0.0.1", "--port", "8123"]
    assert ServerControl.command(None, "builtin:smollm2-135m", 8123) == [sys.executable, "-m", "engine.cli", "serve",
                                                                           *args]
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    assert ServerControl.command(None, "builtin:smollm2-135m", 8123) == [sys.executable, "serve", *args]
