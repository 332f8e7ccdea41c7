"""`tandem bench e2e` on the CPU (simulated hybrid): one record per policy and point, the KV filled
through each policy's own routing, policies swapped in place without reloading the model."""

import json

import pytest

from engine.bench import e2e
from engine.cli import main
from engine.errors import ConfigError


def test_e2e_records_every_policy_and_point(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    rc = main(["bench", "e2e", "--model", "builtin:smollm2-135m", "--kv-policies", "writescope,resident",
               "--batch-sizes", "1,2", "--contexts", "40", "--new-tokens", "3", "--vram-budget-gb", "0",
               "--device", "cpu", "--simulate-hybrid", "--expert-policy", "resident", "--json", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["bench"] == "e2e" and record["complete"] and record["command"] and record["machine"]["cpu"]
    assert [(r["kv_policy"], r["bs"], r["context"]) for r in record["results"]] == [
        ("writescope", 1, 40), ("writescope", 2, 40), ("resident", 1, 40), ("resident", 2, 40)]
    for r in record["results"]:
        assert r["decode_tok_s"] > 0 and r["fill"] == "kv"
        assert r["prefilled_tokens"] == r["bs"]  # the filled context was reused: one token each to prefill
        assert r["kv_bytes_per_step"] == r["bs"] * 40 * 2 * 3 * 64 * 4 * 30  # bs·L·(k,v)·n_kv·hs·fp32·layers
    ws = record["results"][1]
    assert sum(ws["kv_tokens"].values()) == 2 * (40 + 3)  # both sequences' tokens, all in hybrid regions
    capsys.readouterr()


def test_e2e_refuses_an_unknown_policy():
    with pytest.raises(ConfigError):
        e2e.run(model="builtin:smollm2-135m", kv_policies=("resident", "sideways"), expert_policy="resident",
                batch_sizes=(1,), contexts=(16,), new_tokens=2, vram_budget_gb=None, device="cpu",
                simulate_hybrid=True, progress=lambda s: None)
