"""`tandem bench cpu-kernels` on tiny sizes: every section present, figures positive, the summary built."""

from engine.bench import cpu_kernels
from engine.kernels import native


def test_bench_record_on_tiny_sizes():
    record = cpu_kernels.run(threads=[1], lengths=[300], batches=[1, 2], tokens=[1, 3], repeats=1,
                             stream_bytes=4 << 20, q_heads=8, kv_heads=2, head_dim=64, hidden=64, ffn=32, pcie_ms=0,
                             moe_tokens=[1, 3], moe_layer_experts=2, moe_cycled=4)
    assert record["benchmark"] == "cpu-kernels" and record["machine"]["cpu"]
    assert record["stream"][0]["read_GBps"] > 0 and record["stream"][0]["copy_GBps"] > 0
    assert [(r["batch"], r["length"], r["threads"]) for r in record["attention"]] == [(1, 300, 1), (2, 300, 1)]
    for r in record["attention"]:
        assert r["native_GBps"] > 0 and r["torch_sdpa_GBps"] > 0 and r["kv_bytes"] == 2 * r["batch"] * 300 * 2 * 64 * 2
    points = [p for p in record["experts"]["points"] if p["threads"] == 1]  # (the bench adds all cores but one)
    assert [p["tokens"] for p in points] == [1, 3] and all(p["torch_ms"] > 0 for p in record["experts"]["points"])
    if native.module() is not None:
        assert all(p["native_ms"] > 0 for p in points)
        # explicit thread counts apply to the experts too, with the same threads' plain read beside them
        assert all(p["threads"] == 1 and p["native_fraction_of_read"] > 0 for p in points)
        assert set(record["experts"]["crossover_tokens"]) == {"1"}
    assert record["summary"]["length"] == 300 and "bs1" in record["summary"]
    moe = record["moe"]["points"]
    assert [(p["tokens_per_expert"], p["threads"]) for p in moe] == [(1, 1), (3, 1)]
    for p in moe:
        assert p["layer_bytes"] == 2 * 3 * 64 * 32 * 2 and p["experts_cycled"] == 4
        for way in ("per_expert", "moe_ffn"):
            assert all(p[way][k] > 0 for k in ("main_thread_ms", "worker_ms", "worker_busy_main_ms"))
    assert record["summary"]["moe_3_tokens_threads_1"]["speedup"] > 0


def test_bench_sections():
    record = cpu_kernels.run(threads=[1], tokens=[1], repeats=1, hidden=64, ffn=32, moe_tokens=[2],
                             moe_layer_experts=2, moe_cycled=2, sections=["moe"])
    assert "moe" in record and not {"stream", "attention", "experts"} & set(record)
    assert set(record["summary"]) == {"moe_2_tokens_threads_1"}
    if native.module() is not None and record["moe"]["openmp_runtime_used"]:  # the team's runtime is mapped
        assert record["moe"]["openmp_runtime_used"] in record["moe"]["openmp_runtimes_mapped"]


def test_parse_list():
    assert cpu_kernels.parse_list("2k, 32K,100") == [2048, 32768, 100]
    assert cpu_kernels.parse_list(None) is None
