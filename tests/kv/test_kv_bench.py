"""The `tandem bench kv` function runs every policy through the real append path (simulated here)."""

import json

from engine.bench.kv import AttentionShape, run


def test_bench_kv_records_every_policy_and_point():
    policies = ("gpu-centric", "cpu-centric", "writescope", "fixed:0.5", "monolithic", "resident")
    lines = []
    record = run(policies, batch_sizes=(1, 2), lengths=(70,), shape=AttentionShape(4, 2, 16, 2),
                 d_window=16, block_size=8, steps=2, warmup=1, progress=lines.append)
    json.dumps(record)  # plain JSON
    assert record["bench"] == "kv" and record["machine"]["logical_cores"] > 0
    records = record["points"]
    assert len(records) == len(policies) * 2 == len(lines)
    for rec in records:
        assert "error" not in rec, rec
        assert rec["decode_ms_per_layer"] > 0 and rec["kv_bytes_per_layer"] == rec["bs"] * 70 * 2 * 2 * 16 * 4
        assert rec["prefill_route_ms"] > 0 and rec["prefill_ideal_ms"] > 0
    by = {(r["policy"], r["bs"]): r for r in records}
    assert by[("gpu-centric", 1)]["r_deployed"] == 0.0 and by[("cpu-centric", 2)]["r_deployed"] == 1.0
    assert by[("fixed:0.5", 2)]["h2d_gbps"] > 0
    ws = by[("writescope", 1)]  # started from the A and B that r=0 and r=1 measured at the same point
    assert 0.0 <= ws["r_target"] <= 1.0 and ws["A_ns_per_token"] > 0
