"""`tandem bench transformers`: transformers' own generate on a synthetic preset's shape, timed per step."""

import json

from engine.cli import main


def test_transformers_peer_records_prefill_and_decode(tmp_path, capsys):
    out = tmp_path / "hf.json"
    rc = main(["bench", "transformers", "--model", "synthetic:olmoe-1b-7b-L1", "--contexts", "8,12",
               "--batch-sizes", "1", "--new-tokens", "3", "--device", "cpu", "--json", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["bench"] == "transformers" and record["transformers"]
    assert [(r["context"], r["bs"]) for r in record["results"]] == [(8, 1), (12, 1)]
    for r in record["results"]:
        assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["new_tokens"] == 3
    capsys.readouterr()
