"""The K-quants' super-block path (native/kquant_kernels.h: scales and mins unpacked once per
super-block, the offset term an 8-lane FMA, sub-blocks from shared loads, factors broadcast from
memory) against gguf's dequantisation; mixed K-quant experts in one call are test_quant_moe.py's.

Tolerance as in test_block_types.py: the int16 rounding of the activations moves an output by at most
Σ_b d_b/2 · Σ_{j∈b} |w_j| (d_b = max|x_b|/32767; AVX2's int8 form per 256: d_b = max|x_b|/127), plus
1e-5 of Σ|w||x| for fp32's sums; a scale or min applied to the wrong sub-block, or a row or
super-block misread, is off by O(|w||x|). test_kquant_int8.py holds the int8 form to its own rounding.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from test_block_types import _bound, random_blocks

from engine.kernels import native
from engine.quant import matmul as qm
from engine.quant.blocks import QTYPES, QuantTensor

KQ = [T.Q4_K, T.Q5_K, T.Q6_K]
NAT = native.module()


@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols", [(5, 2048), (6, 1280), (7, 256), (130, 768)])
@pytest.mark.parametrize("n_tokens", [1, 2, 3, 4, 6])
def test_wide_rows_and_odd_row_counts(every_isa, qtype, rows, cols, n_tokens):
    """Many super-blocks a row (2048: 8), row counts off the 4-row tile, token counts off the groups."""
    data = random_blocks(rows, cols, qtype, seed=rows * cols + n_tokens)
    ref_w = dequantize(data, qtype)
    x = torch.randn(n_tokens, cols, generator=torch.Generator().manual_seed(rows)) * 2
    y = qm.quant_linear(x, QuantTensor.from_gguf(data, int(qtype), "w"))
    ref = x @ torch.from_numpy(ref_w).t()
    assert ((y - ref).abs() <= _bound(x, ref_w, every_isa, qtype)).all(), float((y - ref).abs().max())


@pytest.mark.skipif(NAT is None or not hasattr(NAT, "quant_matmul"), reason="no native extension")
@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
def test_strided_activations_and_output(every_isa, qtype):
    """Activation rows further apart than k and output rows wider than the matrix: the kernel must
    step by the strides, and leave the output's padding alone."""
    if every_isa == "torch":
        pytest.skip("a native call")
    rows, cols, n = 9, 512, 3
    data = random_blocks(rows, cols, qtype, seed=11)
    w = torch.from_numpy(data)
    xs = torch.randn(n, cols + 64) * 4
    y = torch.full((n, rows + 5), 7.0)
    parts = np.array([[w.data_ptr(), int(qtype), rows, data.shape[1]]], dtype=np.int64)
    NAT.quant_matmul(parts, cols, xs.data_ptr(), n, cols + 64, y.data_ptr(), rows + 5, 1)
    ref_w, x = dequantize(data, qtype), xs[:, :cols]
    ref = x @ torch.from_numpy(ref_w).t()
    assert ((y[:, :rows] - ref).abs() <= _bound(x, ref_w, every_isa, qtype)).all(), float((y[:, :rows] - ref).abs().max())
    assert (y[:, rows:] == 7.0).all()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_largest_scales_and_mins(every_isa, qtype):
    """Every 6-bit scale and min at 63 (all scale bytes 0xff), d and dmin at their test size, the
    activations at ±(their int16 maximum) in every block: the offset term at its largest."""
    data = random_blocks(12, 1024, qtype, seed=5)
    blocks = data.reshape(12, -1, QTYPES[int(qtype)].block_bytes)
    blocks[:, :, 4:16] = 0xFF
    ref_w = dequantize(data, qtype)
    x = torch.where(torch.rand(4, 1024, generator=torch.Generator().manual_seed(2)) < 0.5, -5.0, 5.0)
    y = qm.quant_linear(x, QuantTensor.from_gguf(data, int(qtype), "w"))
    ref = x @ torch.from_numpy(ref_w).t()
    assert ((y - ref).abs() <= _bound(x, ref_w, every_isa, qtype)).all(), float((y - ref).abs().max())
