"""Dense layers over GGUF blocks on the GPU (engine/kernels/quant_linear_gpu.py) against the same
blocks dequantised (gguf's values in fp32) and F.linear: every kept type at decode sizes (the
matrix-vector kernel), prefill sizes in several dequantised chunks, a bias, bf16 activations, and
embedding rows bit for bit. Interpreted on CPU tensors here (tests/conftest.py sets TRITON_INTERPRET=1
without CUDA); compiled on CUDA with `-m cuda`, where a GGUF's dense layers also load onto the GPU in
blocks (tests/quant/test_quant_expert_store.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

pytest.importorskip("triton")

from test_quant_moe_gpu import TYPES, expert_blocks, on  # noqa: E402

from engine.kernels import quant_linear_gpu  # noqa: E402
from engine.quant.blocks import QuantTensor  # noqa: E402

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=CUDA)]


def weight(qtype, rows: int, cols: int, device) -> QuantTensor:
    return QuantTensor(torch.from_numpy(expert_blocks(rows, cols, qtype, seed=int(qtype))), int(qtype),
                       (rows, cols), "w").to(device)


# fp32 activations: the same fp32 products of the same weights, only the order of the sums differs:
# well under 1e-4 of the largest output. bf16: one rounding of each output (2^-8 relative) plus, on
# the GEMM path, the tile's weights rounded to bf16: 2% of the scale.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decode_and_prefill_sizes_follow_the_dequantised_weight(qtype, device, monkeypatch):
    device = on(device)
    w = weight(qtype, 40, 256, device)  # 40 rows: a partial row tile
    dense = w.dequantize() if device.type == "cpu" else w.to("cpu").dequantize()  # (40, 256) fp32
    monkeypatch.setattr(quant_linear_gpu, "CHUNK_BYTES", 16 * 256 * 4)  # prefill in chunks of 16 rows: 3 chunks
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(40, generator=g)
    for shape in ((1, 256), (2, 3, 256), (12, 256)):  # decode sizes, then prefill's chunks
        x = torch.randn(*shape, generator=g)
        got = quant_linear_gpu.linear(x.to(device), w, bias.to(device)).cpu()
        want = F.linear(x, dense, bias)
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-4 * want.abs().max(), shape


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_activations(device):
    device = on(device)
    w = weight(T.Q4_K, 24, 512, device)
    dense = w.to("cpu").dequantize()
    g = torch.Generator().manual_seed(2)
    for n in (1, 9):
        x = torch.randn(n, 512, generator=g).to(torch.bfloat16)
        got = quant_linear_gpu.linear(x.to(device), w)
        want = F.linear(x.float(), dense)
        assert got.dtype == torch.bfloat16 and (got.float().cpu() - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_embedding_rows_are_the_dequantised_rows(qtype, device):
    device = on(device)
    w = weight(qtype, 30, 256, device)
    ids = torch.tensor([[3, 29, 3], [0, 7, 12]], device=device)
    got = quant_linear_gpu.embedding(ids, w, torch.bfloat16).cpu()
    assert got.shape == (2, 3, 256)
    assert torch.equal(got, w.to("cpu").dequantize()[ids.cpu()].to(torch.bfloat16))  # one rounding, from fp32


def test_misshapen_inputs_are_refused():
    w = weight(T.Q8_0, 8, 64, "cpu")
    with pytest.raises(ValueError, match="float"):
        quant_linear_gpu.linear(torch.zeros(2, 32), w)


def test_the_self_test_passes_where_the_kernels_run(monkeypatch):
    monkeypatch.setattr(quant_linear_gpu, "_WORKS", {})
    device = on("cpu")
    assert quant_linear_gpu.works(device) and quant_linear_gpu._WORKS == {"cpu": True}


def test_kernels_that_fail_here_leave_the_dequantised_paths_with_one_warning(monkeypatch, caplog):
    """A kernel that does not compile on the user's GPU must not fail the load: works() says no (once,
    with a warning), and the loader and the cache keep their dequantised paths."""
    import logging

    def broken(device):
        raise RuntimeError("PTX JIT compilation failed\\nmore")

    monkeypatch.setattr(quant_linear_gpu, "_WORKS", {})
    monkeypatch.setattr(quant_linear_gpu, "_self_test", broken)
    monkeypatch.setattr(quant_linear_gpu, "available", lambda device: True)
    with caplog.at_level(logging.WARNING, logger="tandem"):
        assert not quant_linear_gpu.works(torch.device("cpu")) and not quant_linear_gpu.works(torch.device("cpu"))
    warned = [r.getMessage() for r in caplog.records if "failed on cpu" in r.getMessage()]
    assert len(warned) == 1 and "RuntimeError: PTX JIT compilation failed" in warned[0]
