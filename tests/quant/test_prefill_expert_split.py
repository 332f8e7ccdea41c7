"""A prefill chunk's routed experts over blocks on the CPU: those with few (token, choice) pairs run as one
native set (the integer kernel leads there), those with more as dequantised tiles and a GEMM
(engine/quant/experts.py `QuantResidentExperts.run`, engine/quant/matmul.py `native_max_tokens`).

Bound: the native set rounds its activations (int16 per 32-block, int8 per 256 for AVX2's and AVX-512's K-quants), the
tiles do not; one expert FFN of a Q4_K_M file then differs by well under 2% of the output's scale."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import native
from engine.quant import moe as quant_moe
from engine.quant.matmul import INT8_KQUANT_ISAS, KQUANT_INT8_MAX_TOKENS, NATIVE_MAX_TOKENS, native_max_tokens

llama_cpp = pytest.importorskip("llama_cpp")
NAT = native.module()
pytestmark = pytest.mark.skipif(NAT is None or not hasattr(NAT, "quant_moe"), reason="no native extension")


@pytest.mark.parametrize("isa", ["avx2", "avx512", "avx512vnni", "scalar"])
def test_the_kernel_leads_longer_where_k_quants_read_int8(isa):
    if isa not in NAT.supported_quant_isas():
        pytest.skip(f"this CPU has no {isa}")
    assert NAT.select_quant_isa(isa)
    try:
        k_quants = native_max_tokens([12, 12, 14])  # Q4_K gate and up, Q6_K down
        amx = "amx-bf16" in NAT.supported_isas()  # tiles on the matrix units: the crossover is unmeasured
        assert k_quants == (KQUANT_INT8_MAX_TOKENS if isa in INT8_KQUANT_ISAS and not amx else NATIVE_MAX_TOKENS)
        assert native_max_tokens([12, 8]) == NATIVE_MAX_TOKENS  # a Q8_0 part reads int16 activations
    finally:
        NAT.select_quant_isa("auto")


def test_few_pair_experts_run_natively_and_the_rest_as_tiles(tmp_path, monkeypatch):
    from test_quant_experts_gguf import engine_for, write_quantised

    engine = engine_for(write_quantised(tmp_path, "qwen3_moe", "Q4_K_M"))
    try:
        ex = engine.backend.parts.experts
        g = torch.Generator().manual_seed(0)
        N = 80  # every token's first choice expert 0: 80 pairs, more than any kernel's lead
        x = torch.randn(N, 256, generator=g)
        ids = torch.stack([torch.zeros(N, dtype=torch.long), torch.randint(1, 8, (N,), generator=g)], dim=1)  # (N, 2)
        weights = torch.rand(N, 2, generator=g)
        sets = []
        prepare = quant_moe.prepare
        monkeypatch.setattr(quant_moe, "prepare", lambda *a, **k: sets.append(a[1].copy()) or prepare(*a, **k))
        got = ex.run(0, x, ids, weights)
        monkeypatch.setattr(quant_moe, "prepare", lambda *a, **k: None)  # every expert as tiles + GEMM
        want = ex.run(0, x, ids, weights)
    finally:
        engine.close()
    limit = native_max_tokens(ex.tables[0][1])
    counts = torch.bincount(ids.reshape(-1), minlength=8)
    light = [e for e in range(8) if 0 < counts[e] <= limit]
    assert light and counts[0] > limit  # both kinds present
    table = sets[0]  # (J, 4): the native set's experts' addresses and pair counts
    assert sorted(table[:, 3].tolist()) == sorted(counts[light].tolist())
    assert table[:, 0].tolist() == ex.tables[0][0][light, 0].tolist()  # expert 0's blocks are not among them
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())
    assert float(want.abs().max()) > 0.1
