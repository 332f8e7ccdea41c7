"""engine.bench.quant_kernels at a toy size: every type and shape is timed, warm and cold, and the
record's figures are consistent (GB/s = bytes / µs, the cold ratio against the read it printed), and
the MoE set is timed at each thread count asked for."""

import pytest

from engine.bench import quant_kernels
from engine.kernels import native

NAT = native.module()


@pytest.mark.skipif(NAT is None or not hasattr(NAT, "quant_matmul"), reason="no native extension")
def test_every_shape_is_timed_and_its_figures_agree():
    r = quant_kernels.main(cold_gib=0.005, rounds=1, stream_mib=16, moe_threads=[1, 2], moe_layers=2)
    assert len(r["products"]) == len(quant_kernels.SHAPES)
    for p, (name, code, rows, cols) in zip(r["products"], quant_kernels.SHAPES):
        assert (p["type"], p["rows"], p["cols"]) == (name, rows, cols)
        assert p["bytes"] == rows * cols // 256 * quant_kernels.BLOCK_BYTES[code]
        assert p["warm_us"] > 0 and p["cold_us"] > 0
        assert p["cold_GBps"] == pytest.approx(p["bytes"] / p["cold_us"] / 1e3, rel=0.02)
        assert p["cold_over_stream"] == pytest.approx(p["cold_GBps"] / r["stream_read_GBps"], abs=0.01)
    assert r["stream_read_GBps"] > 0
    assert [m["threads"] for m in r["moe_set"]] == [1, 2] and all(m["ms"] > 0 and m["GBps"] > 0 for m in r["moe_set"])
