"""The GPU measurements (skipped without CUDA; the lead runs them on the GPU machine)."""

import pytest
import torch

from hwcheck import unexplained_nulls
from engine.hw import calibrate as hw
from engine.hw.attention_kernels import DEFAULT_GPU, pick, reference_attention
from engine.hw.hostmem import registered, touched
from engine.hw.kv_costs import PingPongStream
from engine.hw.shapes import ExpertShape, KVShape, ModelShape

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPE = ModelShape("small-bf16", KVShape(8, 2, 64, "bfloat16"), ExpertShape(256, 128, "bfloat16"), n_layers=2,
                   n_experts=4, top_k=2)
PLAN = hw.Plan("test", warmup=1, repeats=3, dram_bytes=32 * 2**20, transfer_sizes=(64 * 2**10, 2**20, 8 * 2**20),
               pin_bytes=8 * 2**20, kv_batches=(1, 2), kv_lengths=(1024, 4096, 10000), pingpong_tokens=1024,
               expert_tokens=(1, 8, 64), concurrency_ms=30.0, split_check_lengths=(2048, 8192), split_check_batch=2)


def test_registered_memory_round_trips_through_async_copies():
    host = touched(4 * 2**20)
    host.copy_(torch.arange(host.numel(), dtype=torch.int64).to(torch.uint8))
    back = touched(4 * 2**20)
    with registered(host), registered(back):
        dev = host.to("cuda", non_blocking=True)
        back.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
    assert torch.equal(back, host)


def test_streamed_ping_pong_attention_is_exact():
    """The GPU side timed for B computes the same attention as one pass over all the keys."""
    kernel, _ = pick(DEFAULT_GPU, 8, 2, 64, torch.bfloat16, torch.device("cuda"))
    pp = PingPongStream(SHAPE.kv, batch=2, max_tokens=5000, chunk_tokens=1024, kernel=kernel)
    with registered(pp.host):
        out, lse = pp.step(4500)  # 4 full chunks and a partial one
        torch.cuda.synchronize()
    chunks = [pp._chunk(pp.host[i * pp.chunk_elems:(i + 1) * pp.chunk_elems], min(1024, 4500 - i * 1024))
              for i in range(5)]
    k = torch.cat([c[0] for c in chunks], dim=2).cuda()  # (B, n_kv, 4500, hs)
    v = torch.cat([c[1] for c in chunks], dim=2).cuda()
    ref_out, ref_lse = reference_attention(pp.q, k, v, 64 ** -0.5)
    assert (out.float() - ref_out.float()).abs().max().item() < 2e-2
    assert (lse - ref_lse).abs().max().item() < 2e-2


def test_cuda_calibration_fills_every_gpu_field():
    steps = []
    data = hw.calibrate(SHAPE, plan=PLAN, progress=lambda step, frac: steps.append(frac))
    assert steps == sorted(steps) and steps[-1] == 1.0
    assert unexplained_nulls(data) == []
    assert data["machine"]["gpu"]["available"] and data["machine"]["gpu"]["name"]
    tr = data["transfer"]
    for d in ("h2d", "d2h"):
        for kind in ("pinned", "pageable", "strided"):
            assert [p["bytes"] for p in tr[d][kind]][:1] == [64 * 2**10] and all(p["GBps"] > 0 for p in tr[d][kind])
    assert tr["h2d"]["pinned"][-1]["GBps"] > tr["h2d"]["pageable"][-1]["GBps"]  # pinning pays at 8 MiB
    assert data["pinning"]["register_ms_per_MB"] > 0
    entry = data["shapes"][SHAPE.key]
    for batch in ("1", "2"):
        c = entry["kv"]["by_batch"][batch]
        assert c["A_ns_per_token"] > 0 and c["B_ns_per_token"] > 0
        assert c["delta_ms"] == pytest.approx(c["C_gpu_ms"] - c["C_cpu_ms"])
    ex = entry["experts"]
    assert len(ex["gpu_ms"]) == 3 and ex["fill_ms"] > 0 and ex["B_P_GBps"] > 0
    assert ex["B_R_GBps"] == max(ex["B_H_GBps"] - ex["B_P_GBps"], 0.0)
    assert ex["concurrent"]["fills"] >= 8 and ex["concurrent"]["B_P_GBps"] > 0
    rows = entry["split_check"]["rows"]
    assert [row["L"] for row in rows] == [2048, 8192]
    for row in rows:
        assert 0.0 <= row["r_predicted"] <= 1.0 and row["ms_best"] <= min(t for _, t in row["ms_by_r"]) + 1e-9
        assert row["ms_at_predicted"] > 0
