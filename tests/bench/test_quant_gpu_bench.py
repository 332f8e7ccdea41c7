"""engine.bench.quant_gpu: it says plainly that it needs CUDA where there is none, and its random blocks
are valid blocks of each type (the kernels' inputs), with the factors it says."""

import pytest
import torch

from engine.bench import quant_gpu
from engine.quant.blocks import QuantTensor


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_refuses_with_the_reason():
    with pytest.raises(SystemExit, match="no CUDA device here"):
        quant_gpu.run(reps=1)


@pytest.mark.parametrize("code", [12, 14, 8])
def test_random_blocks_are_valid_blocks_with_small_factors(code):
    blocks = quant_gpu.random_blocks(6, 512, code, torch.Generator().manual_seed(0), "cpu")
    values = QuantTensor(blocks, code, (6, 512), "w").dequantize()
    assert torch.isfinite(values).all() and 0 < values.abs().max() <= 4.0  # Q6_K: 2^-10 · 127 · 32 at most


def test_a_sweep_measures_every_setting_and_restores_the_tiles():
    from engine.kernels import quant_moe_gemm_gpu as gemm

    before = (gemm.BM, gemm.WARPS)
    rows = quant_gpu.swept(gemm, {"BM": (16, 32), "WARPS": (4, 8)}, True, lambda: {"us": gemm.BM * gemm.WARPS})
    assert rows == [{"BM": 16, "WARPS": 4, "us": 64}, {"BM": 16, "WARPS": 8, "us": 128},
                    {"BM": 32, "WARPS": 4, "us": 128}, {"BM": 32, "WARPS": 8, "us": 256}]
    assert (gemm.BM, gemm.WARPS) == before
    assert quant_gpu.swept(gemm, {"BM": (16, 32)}, False, lambda: {}) == [{"BM": before[0]}]  # the current tile only
