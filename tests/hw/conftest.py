import pytest


@pytest.fixture(autouse=True)
def private_data_dir(tmp_path, monkeypatch):
    """Every hw test reads and writes profiles in its own folder, never the user's."""
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"

