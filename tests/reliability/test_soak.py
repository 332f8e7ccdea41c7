"""The soak benchmark, short: 300 decode steps of the built-in MoE model on the simulated hybrid path
(D-window 16, 48 expert slots: a flush every 16 tokens, fills and evictions on every layer), each
token checked against resident execution, resources sampled per window. The 10,000-step run is
`tandem bench soak` (benchmarks/RESULTS.md)."""

import json

import pytest

from engine.bench import soak
from engine.cli import main as cli_main


@pytest.fixture(autouse=True)
def one_torch_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the simulated CPU side runs on a second thread (see tests/kv/conftest.py)
    yield
    torch.set_num_threads(n)


def test_soak_300_steps(tmp_path, capsys):
    out = tmp_path / "soak.json"
    rc = cli_main(["bench", "soak", "--steps", "300", "--window", "100", "--json", str(out)])
    record = json.loads(out.read_text())
    assert rc == 0, record["growth"]
    assert record["steps"] == 300 and len(record["windows"]) == 3
    for w in record["windows"]:
        assert w["ok"], w  # every hybrid token is the resident argmax (or a near-tie of it)
        assert w["experts"]["fills"] > 0 and w["experts"]["evictions"] > 0
    assert record["windows"][-1]["pcie_d2h_bytes"] > 0  # D-window flushes happened
    g = record["growth"]
    assert g["checked"] and g["ok"], g
    # no growth: ≤ 0 (a file closed during the run, e.g. a lazily opened log, counts as a fall, not a leak)
    assert g["fds"]["growth"] <= 0 and g["pinned"]["growth"] <= 0, g
    assert g["rss"]["growth"] <= soak.RSS_BOUND_BYTES
